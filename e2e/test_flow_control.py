"""Flow control through a real Envoy: with every replica's engine reporting a
full queue, a request is held (longer than Envoy's own message timeout, which the
sidecar extends for it) and released to the replica that frees; a full queue
sheds at once and a held request past maxQueueWait is shed, both with 429 and
retry-after; a held request whose client goes away leaves the queue at once; a
higher priority held later is released first."""

import concurrent.futures
import shutil
import tempfile
import pathlib
import time

import pytest
import requests

import cachewire
from conftest import (MODEL, REPLICAS, SCHEME, TENANT, Envoy, Sidecar, Upstream,
                      policy_yaml, wait_until)
from test_routing import chain, chain_headers, hold


class FlowStack:
    """Upstreams + sidecar + Envoy with flow control on in the tenant's policy."""

    def __init__(self, mode, template, max_wait, max_queued):
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="inferencecache-e2e-flow-"))
        self.upstreams = [Upstream(r) for r in REPLICAS]
        policy = policy_yaml(self.upstreams).replace(
            "  affinityRouting: Enabled\n",
            "  affinityRouting: Enabled\n"
            # Engine reports stay in force for the whole test.
            "  loadBalancing: {statsMaxAge: 120s}\n"
            f"  flowControl: {{enabled: true, maxQueueWait: {max_wait}, "
            f"maxQueuedRequests: {max_queued}}}\n")
        assert "flowControl" in policy
        self.sidecar = Sidecar(self.workdir, self.upstreams, mode, policy=policy)
        self.envoy = Envoy(self.workdir, template, self.sidecar, self.upstreams)

    def report(self, replica, waiting):
        cachewire.report_stats(self.sidecar.ingest_addr, TENANT, MODEL, SCHEME, replica,
                               waiting=waiting, token=self.sidecar.ingest_token)

    def saturate(self):
        for r in REPLICAS:
            self.report(r, 20)

    def get(self, headers):
        # Far above any hold here: the answer, not the client, ends the wait.
        return requests.get(self.envoy.url + "/v1/completions", headers=headers, timeout=60)

    def metric(self, line_start):
        text = requests.get(f"{self.sidecar.admin}/metrics", timeout=2).text
        for line in text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
        return None

    def close(self):
        self.envoy.stop()
        self.sidecar.stop()
        for u in self.upstreams:
            u.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


HELD = 'inferencecache_flow_queued_requests{priority="0"}'


@pytest.fixture
def held_stack():
    # override-host: Envoy's message timeout is 1s and it fails open, so a hold
    # Envoy did not extend would come back unrouted.
    stack = FlowStack("override-host", "override-host.yaml", max_wait="25s", max_queued=8)
    yield stack
    stack.close()


@pytest.fixture
def shedding_stack():
    stack = FlowStack("original-dst", "original-dst.yaml", max_wait="3s", max_queued=1)
    yield stack
    stack.close()


def test_a_held_request_is_released_to_the_replica_that_frees(held_stack):
    s = held_stack
    hashes = chain()
    hold(s, "replica-b", hashes)
    s.saturate()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        started = time.monotonic()
        reply = pool.submit(s.get, dict(chain_headers(hashes),
                                         **{"x-inferencecache-priority": "3"}))
        wait_until(lambda: s.metric('inferencecache_flow_queued_requests{priority="3"}') == 1,
                   timeout=20, what="the request held")
        # Held past Envoy's 1s message timeout: the sidecar asked it to wait.
        time.sleep(2.5)
        assert not reply.done(), reply.result().headers
        s.report("replica-c", 0)
        r = reply.result(timeout=40)
        waited = time.monotonic() - started
    assert r.status_code == 200, (r.status_code, r.text)
    # Decided at release: replica-b holds the blocks but is still full, so the
    # load rule sends the request to replica-c, which just drained.
    assert r.text == "replica-c"
    assert r.headers["x-inferencecache-reason"] == "PREFIX_MATCH"
    assert r.headers["x-inferencecache-spilled-from"] == "replica-b"
    assert r.headers["x-upstream-saw-destination"] == s.upstreams[2].address
    queued_ms = int(r.headers["x-inferencecache-queued-ms"])
    assert 2500 <= queued_ms <= waited * 1000 + 100, (queued_ms, waited)
    wait_until(lambda: s.metric('inferencecache_flow_queued_requests{priority="3"}') == 0,
               timeout=10, what="the queue empty")
    assert s.metric("inferencecache_flow_queue_wait_seconds_count") == 1
    envoy = s.envoy.stats("http.ingress.ext_proc.")
    assert envoy.get("http.ingress.ext_proc.override_message_timeout_received") == 1, envoy
    assert envoy.get("http.ingress.ext_proc.message_timeouts", 0) == 0, envoy


def test_a_full_queue_and_a_long_wait_are_shed_with_429(shedding_stack):
    s = shedding_stack
    hashes = chain()
    hold(s, "replica-a", hashes)
    s.saturate()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        first = pool.submit(s.get, chain_headers(hashes))
        wait_until(lambda: s.metric(HELD) == 1, timeout=20, what="the first request held")
        # The queue holds one: the next is shed at once.
        r = s.get(chain_headers(hashes))
        assert r.status_code == 429, (r.status_code, r.text)
        assert r.headers["retry-after"] == "3"
        assert r.headers["x-inferencecache-shed"] == "queue-full"
        # The first waits its 3s (past Envoy's 2s message timeout) and is shed.
        r = first.result(timeout=40)
    assert r.status_code == 429, (r.status_code, r.text)
    assert r.headers["x-inferencecache-shed"] == "queue-timeout"
    assert r.headers["retry-after"] == "3"
    assert int(r.headers["x-inferencecache-queued-ms"]) >= 3000
    assert s.metric('inferencecache_flow_shed_total{reason="queue-full"}') == 1
    assert s.metric('inferencecache_flow_shed_total{reason="queue-timeout"}') == 1
    # Below saturation again: decided at once, as without flow control.
    for replica in REPLICAS:
        s.report(replica, 0)
    r = s.get(chain_headers(hashes))
    assert r.status_code == 200
    assert r.text == "replica-a"
    assert "x-inferencecache-queued-ms" not in r.headers


def test_a_held_request_whose_client_goes_away_leaves_the_queue_at_once(held_stack):
    s = held_stack
    s.saturate()
    # The client gives up after a second; maxQueueWait is 25 s.
    with pytest.raises(requests.exceptions.ReadTimeout):
        requests.get(s.envoy.url + "/v1/completions", headers=chain_headers(chain()),
                     timeout=(5, 1))
    wait_until(lambda: s.metric(HELD) == 0, timeout=10, what="the request gone from the queue")
    # It left: neither released nor shed.
    assert s.metric("inferencecache_flow_queue_wait_seconds_count") == 0
    for reason in ("queue-full", "queue-timeout", "expected-timeout", "priority"):
        assert s.metric(f'inferencecache_flow_shed_total{{reason="{reason}"}}') == 0, reason
    # The queue still works: the next request is held and released.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        reply = pool.submit(s.get, chain_headers(chain()))
        wait_until(lambda: s.metric(HELD) == 1, timeout=20, what="the next request held")
        s.report("replica-c", 0)
        r = reply.result(timeout=40)
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.text == "replica-c"


def test_a_higher_priority_held_later_is_released_first(held_stack):
    s = held_stack
    # replica-c holds the first four blocks (64 tokens, the default
    # minimumMatchedTokens) of both prompts: released, each goes there (a
    # PREFIX_MATCH, not wherever the affinity hint points) with the rest of
    # its prefill to do, and fills it again.
    low, high = chain(), chain()
    for hashes in (low, high):
        hold(s, "replica-c", hashes[:4])
    s.saturate()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(s.get, chain_headers(low))
        wait_until(lambda: s.metric(HELD) == 1, timeout=20, what="priority 0 held")
        second = pool.submit(s.get, dict(chain_headers(high),
                                          **{"x-inferencecache-priority": "5"}))
        wait_until(lambda: s.metric('inferencecache_flow_queued_requests{priority="5"}') == 1,
                   timeout=20, what="priority 5 held")
        # Room for one request at replica-c: 7 waiting + the one released.
        s.report("replica-c", 7)
        done, _ = concurrent.futures.wait([first, second], timeout=40,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        assert done == {second}, "priority 0 was released first"
        assert s.metric(HELD) == 1
        r = second.result()
        assert r.status_code == 200, (r.status_code, r.text)
        assert r.text == "replica-c"
        # The engine took it: the lower priority goes next.
        s.report("replica-c", 0)
        r = first.result(timeout=40)
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.text == "replica-c"
