"""Fleet sync through real Envoys and a real nats-server: two sidecars with
--fleet-nats route as one (a holder only sidecar 1 loaded spills for sidecar
2; a tenant served through one sidecar queues behind another at the other),
NATS lost mid-traffic fails no request and sync resumes when it is back, a
killed peer's routes go within 3 s, a cleanly stopped peer's at once, and
forged or garbage messages change nothing."""

import concurrent.futures
import pathlib
import secrets
import shutil
import signal
import tempfile
import threading
import time

import pytest
import requests

import cachewire
from conftest import (MODEL, REPLICAS, SCHEME, TENANT, Envoy, Sidecar, Upstream,
                      backend_yaml, wait_until)
from natsserver import NatsServer, nats_server_binary, publish
from test_routing import chain, chain_headers

TIMEOUT = 20  # generous: two loaded cores run everything here


def _slow_get(envoy, headers):
    """A request whose response the upstream holds for a while."""
    return requests.get(envoy.url + "/v1/completions", headers=headers, timeout=60)


def _metrics(sidecar) -> dict:
    out = {}
    for line in requests.get(f"{sidecar.admin}/metrics", timeout=5).text.splitlines():
        if line.startswith("inferencecache_fleet_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _fleet(sidecar) -> dict:
    r = requests.get(f"{sidecar.admin}/readyz", timeout=5)
    assert r.status_code == 200, r.text  # the fleet never makes a sidecar unready
    return r.json()["fleet"]


def _replica(sidecar, replica) -> dict:
    snap = requests.get(f"{sidecar.admin}/snapshot", timeout=5).json()
    return next(r for r in snap["replicas"] if r["replicaId"] == replica)


class Fleet:
    """Three upstreams, one nats-server, two sidecars (s1, s2) each behind its
    own Envoy, all in one fleet."""

    def __init__(self, policy=None):
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="inferencecache-fleet-"))
        self.name = "e2e" + secrets.token_hex(4)
        self.nats = NatsServer(self.workdir)
        self.upstreams = [Upstream(r) for r in REPLICAS]
        self.sidecars, self.envoys = [], []
        for i in (1, 2):
            d = self.workdir / f"s{i}"
            d.mkdir()
            sc = Sidecar(d, self.upstreams, "override-host", extra_args=(
                "--fleet-nats", self.nats.url, "--fleet-id", f"s{i}",
                "--fleet-name", self.name),
                policy=policy(self.upstreams) if policy else None)
            self.sidecars.append(sc)
            self.envoys.append(Envoy(d, "override-host.yaml", sc, self.upstreams))
        self.wait_synced()

    def wait_synced(self):
        for sc in self.sidecars:
            wait_until(lambda: _fleet(sc)["connected"] and _fleet(sc)["peers"] == 1,
                       timeout=TIMEOUT, what="both sidecars connected and hearing each other")

    def hold(self, replica, hashes, token_counts=()):
        """`replica`'s engine stores `hashes`: both sidecars get the event."""
        for sc in self.sidecars:
            if sc.proc.poll() is not None:
                continue
            out = cachewire.ingest(sc.ingest_addr, TENANT, MODEL, SCHEME, replica,
                                   [cachewire.stored_event(hashes, token_counts)],
                                   token=sc.ingest_token)
            assert out == {"applied": 1, "rejected": 0}

    def close(self):
        for e in self.envoys:
            e.stop()
        for sc in self.sidecars:
            sc.stop()
        self.nats.stop()
        for u in self.upstreams:
            u.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def fleet():
    nats_server_binary()  # fail, never skip, without it
    f = Fleet()
    yield f
    f.close()


FAIR_TENANTS = ("busy", "quiet")


def _fair_policy(upstreams) -> str:
    """Tenants busy and quiet, each in its own namespace in Fairness mode (weight
    1) with flow control on, both served by every upstream."""
    docs = []
    for tenant in FAIR_TENANTS:
        docs.append(f"""apiVersion: inferencecache.io/v1alpha1
kind: CacheTenant
metadata: {{name: {tenant}, namespace: {tenant}}}
spec:
  tenantID: {tenant}
  isolationMode: Fairness
---
apiVersion: inferencecache.io/v1alpha1
kind: CachePolicy
metadata: {{name: default, namespace: {tenant}}}
spec:
  affinityRouting: Enabled
  loadBalancing: {{statsMaxAge: 120s}}
  flowControl: {{enabled: true, maxQueueWait: 25s, maxQueuedRequests: 8}}
---
{backend_yaml(upstreams, tenant)}""")
    return "---\n".join(docs)


@pytest.fixture
def fair_fleet():
    nats_server_binary()  # fail, never skip, without it
    f = Fleet(policy=_fair_policy)
    yield f
    f.close()


def _held(sidecar) -> float:
    for line in requests.get(f"{sidecar.admin}/metrics", timeout=5).text.splitlines():
        if line.startswith('inferencecache_flow_queued_requests{priority="0"} '):
            return float(line.rpartition(" ")[2])
    return 0.0


def _report_all(sidecar, replica, waiting):
    for tenant in FAIR_TENANTS:
        cachewire.report_stats(sidecar.ingest_addr, tenant, MODEL, SCHEME, replica,
                               waiting=waiting, token=sidecar.ingest_token)


def test_a_tenant_served_through_one_sidecar_queues_behind_another_at_the_other(fair_fleet):
    """Tenant shares are the fleet's: "busy" is served ten requests through
    sidecar 2; at sidecar 1, whose own traffic so far is none, "busy" and
    "quiet" then queue one request each, "busy" first, and one replica frees
    for one request. It goes to "quiet", as it would had sidecar 1 served
    those ten itself (alone, the earlier "busy" would go first)."""
    f = fair_fleet
    s1 = f.sidecars[0]
    # replica-c holds the first four blocks (64 tokens, the default
    # minimumMatchedTokens) of the prompts sidecar 1 will hold: released, they
    # go there as a PREFIX_MATCH, with the rest of their prefill still to do.
    prompts = {t: chain() for t in FAIR_TENANTS}
    for tenant, hashes in prompts.items():
        out = cachewire.ingest(s1.ingest_addr, tenant, MODEL, SCHEME, "replica-c",
                               [cachewire.stored_event(hashes[:4])], token=s1.ingest_token)
        assert out == {"applied": 1, "rejected": 0}
    slow = lambda envoy, tenant, hashes=None: _slow_get(envoy, dict(
        chain_headers(hashes or chain(), tenant=tenant), **{"x-test-hold-ms": "2000"}))
    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        served = [pool.submit(slow, f.envoys[1], "busy") for _ in range(10)]
        # Sidecar 1 has applied the ten routes (each charged as it arrived).
        wait_until(lambda: _total(s1, "peerInflightRequests") == 10, timeout=TIMEOUT,
                   what="sidecar 1 seeing sidecar 2's ten routes")
        for r in REPLICAS:
            _report_all(s1, r, 20)
        busy = pool.submit(slow, f.envoys[0], "busy", prompts["busy"])
        wait_until(lambda: _held(s1) == 1, timeout=TIMEOUT, what="busy held at sidecar 1")
        quiet = pool.submit(slow, f.envoys[0], "quiet", prompts["quiet"])
        wait_until(lambda: _held(s1) == 2, timeout=TIMEOUT, what="quiet held at sidecar 1")
        for r in served:
            assert r.result(timeout=60).status_code == 200
        wait_until(lambda: _total(s1, "peerInflightRequests") == 0, timeout=TIMEOUT,
                   what="sidecar 2's routes released at sidecar 1")
        # Room for one request at replica-c: 7 waiting + the one released.
        _report_all(s1, "replica-c", 7)
        done, _ = concurrent.futures.wait([busy, quiet], timeout=60,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        assert done == {quiet}, "busy was released first"
        assert _held(s1) == 1
        r = quiet.result()
        assert r.status_code == 200, (r.status_code, r.text)
        assert r.text == "replica-c", r.headers
        # The engine reports it took that one: "busy" goes.
        _report_all(s1, "replica-c", 0)
        r = busy.result(timeout=60)
        assert r.status_code == 200, (r.status_code, r.text)
        assert r.text == "replica-c", r.headers


def _long_prompt(f, hold_ms):
    """A prompt replica-b holds the first block of, bringing 3000 uncached
    tokens of prefill there, with its response held `hold_ms`."""
    big = chain(4)
    f.hold("replica-b", big[:1])
    headers = dict(chain_headers(big), **{
        "x-inferencecache-block-token-counts": "64,1000,1000,1000",
        "x-test-hold-ms": str(hold_ms),
    })
    return big, headers


def _spills_for_s2(f, probe) -> bool:
    r = f.envoys[1].get(chain_headers(probe))
    assert r.status_code == 200
    assert r.headers["x-inferencecache-reason"] == "PREFIX_MATCH"
    return r.headers.get("x-inferencecache-spilled-from") == "replica-b"


def _total(sidecar, field) -> int:
    snap = requests.get(f"{sidecar.admin}/snapshot", timeout=5).json()
    return sum(r[field] for r in snap["replicas"])


def _backlog_seen_by_s2(f):
    return _replica(f.sidecars[1], "replica-b")["peerInflightTokens"] == 3000


def test_sidecar_2_spills_off_a_holder_only_sidecar_1_loaded(fleet):
    f = fleet
    probe = chain()
    f.hold("replica-b", probe)
    assert not _spills_for_s2(f, probe)
    big, headers = _long_prompt(f, 6000)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(_slow_get, f.envoys[0], headers)
        wait_until(lambda: _replica(f.sidecars[0], "replica-b")["inflightTokens"] == 3000,
                   timeout=TIMEOUT, what="s1 counts its long prompt on replica-b")
        wait_until(lambda: _backlog_seen_by_s2(f), timeout=TIMEOUT,
                   what="s2 sees s1's backlog on replica-b")
        b = _replica(f.sidecars[1], "replica-b")
        assert b["peerInflightRequests"] == 1 and b["inflightRequests"] == 0, b
        r = f.envoys[1].get(chain_headers(probe))
        assert r.headers.get("x-inferencecache-spilled-from") == "replica-b", dict(r.headers)
        assert r.headers.get("x-inferencecache-spilled-by") == "prefill", dict(r.headers)
        assert r.text != "replica-b"
        # The engine stores the long prompt: s1 publishes its prefill's end and
        # s2 goes back to the holder while the request still runs.
        f.hold("replica-b", big, (64, 1000, 1000, 1000))
        wait_until(lambda: _replica(f.sidecars[1], "replica-b")["peerInflightTokens"] == 0,
                   timeout=TIMEOUT, what="s1's prefill end reaching s2")
        assert not _spills_for_s2(f, probe)
        assert held.result().status_code == 200
    wait_until(lambda: _replica(f.sidecars[1], "replica-b")["peerInflightRequests"] == 0,
               timeout=TIMEOUT, what="s1's release reaching s2")
    m = _metrics(f.sidecars[0])
    assert m["inferencecache_fleet_messages_published_total"] >= 3  # routed, prefill end, release
    assert m["inferencecache_fleet_connected"] == 1


def test_nats_lost_mid_traffic_fails_nothing_and_sync_resumes(fleet):
    f = fleet
    probe = chain()
    f.hold("replica-b", probe)
    failures, sent, stop = [], [0], threading.Event()

    def traffic(envoy):
        while not stop.is_set():
            try:
                r = envoy.get(chain_headers(probe))
                sent[0] += 1
                if r.status_code != 200:
                    failures.append(r.status_code)
            except requests.RequestException as e:
                failures.append(repr(e))

    threads = [threading.Thread(target=traffic, args=(e,)) for e in f.envoys]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        f.nats.kill()
        for sc in f.sidecars:
            wait_until(lambda: _fleet(sc)["view"] == "own", timeout=TIMEOUT,
                       what="the fleet view degraded to the sidecar's own")
            assert _metrics(sc)["inferencecache_fleet_connected"] == 0
        before = sent[0]
        wait_until(lambda: sent[0] > before + 20, timeout=TIMEOUT, what="traffic while NATS is down")
        # Without NATS s2 cannot see s1's routes (wherever s1's own load rule
        # sent its long prompt amid the traffic).
        big, headers = _long_prompt(f, 4000)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            held = pool.submit(_slow_get, f.envoys[0], headers)
            wait_until(lambda: _total(f.sidecars[0], "inflightTokens") >= 3000,
                       timeout=TIMEOUT, what="s1 counts its long prompt")
            assert _total(f.sidecars[1], "peerInflightTokens") == 0
            assert held.result().status_code == 200
        f.nats.start()
        f.wait_synced()
        before = sent[0]
        wait_until(lambda: sent[0] > before + 20, timeout=TIMEOUT, what="traffic after NATS is back")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert failures == [], failures[:10]
    # Sync resumed without a restart: s2 sees s1's new routes again.
    big, headers = _long_prompt(f, 4000)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(_slow_get, f.envoys[0], headers)
        wait_until(lambda: _total(f.sidecars[1], "peerInflightTokens") >= 3000,
                   timeout=TIMEOUT, what="s2 sees s1's backlog after NATS is back")
        assert held.result().status_code == 200
    for sc in f.sidecars:
        assert _metrics(sc)["inferencecache_fleet_connected"] == 1


def test_a_killed_peers_routes_go_within_3_seconds(fleet):
    f = fleet
    big, headers = _long_prompt(f, 15000)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    held = pool.submit(_slow_get, f.envoys[0], headers)
    try:
        wait_until(lambda: _replica(f.sidecars[1], "replica-b")["peerInflightRequests"] == 1,
                   timeout=TIMEOUT, what="s2 sees s1's route")
        f.sidecars[0].proc.send_signal(signal.SIGKILL)
        f.sidecars[0].proc.wait()
        killed = time.monotonic()
        wait_until(lambda: _replica(f.sidecars[1], "replica-b")["peerInflightRequests"] == 0,
                   timeout=TIMEOUT, what="s1's route gone from s2")
        elapsed = time.monotonic() - killed
        assert elapsed < 3.0, elapsed
        m = _metrics(f.sidecars[1])
        assert m["inferencecache_fleet_peers_expired_total"] == 1
        assert m["inferencecache_fleet_peers"] == 0
    finally:
        f.envoys[0].stop()  # ends the held request
        try:
            held.result(timeout=TIMEOUT)
        except Exception:
            pass  # its sidecar is gone: Envoy's answer does not matter here
        pool.shutdown()


def test_a_cleanly_stopped_peers_routes_go_at_once(fleet):
    f = fleet
    s1, s2 = f.sidecars
    big, headers = _long_prompt(f, 15000)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    held = pool.submit(_slow_get, f.envoys[0], headers)
    try:
        wait_until(lambda: _replica(s2, "replica-b")["peerInflightRequests"] == 1,
                   timeout=TIMEOUT, what="s2 sees s1's route")
        s1.proc.send_signal(signal.SIGTERM)
        # The drain waits on the held stream up to --drain-timeout (5 s), then
        # s1 leaves: s2 drops its routes on the leave, not the heartbeat timeout.
        s1.proc.wait(timeout=TIMEOUT)
        exited = time.monotonic()
        wait_until(lambda: _metrics(s2)["inferencecache_fleet_peers"] == 0,
                   timeout=TIMEOUT, what="s1 gone from s2's peers")
        assert time.monotonic() - exited < 1.5
        assert _replica(s2, "replica-b")["peerInflightRequests"] == 0
        assert _metrics(s2)["inferencecache_fleet_peers_expired_total"] == 0, "left, not expired"
    finally:
        f.envoys[0].stop()
        try:
            held.result(timeout=TIMEOUT)
        except Exception:
            pass
        pool.shutdown()


def _routed(peer, epoch, seq, route, replica="replica-b", tokens=5000):
    """A routed fact as the sidecars encode it (protobuf, format version 2)."""
    w = cachewire
    routed = (w._field(1, 0, w._varint(route)) + w._string(2, TENANT) + w._string(3, MODEL)
              + w._string(4, SCHEME) + w._string(5, replica) + w._field(6, 0, w._varint(tokens)))
    return (w._field(1, 0, w._varint(2)) + w._string(2, peer) + w._field(3, 0, w._varint(epoch))
            + w._field(4, 0, w._varint(seq)) + w._bytes_field(5, routed))


def test_forged_and_garbage_messages_change_nothing(fleet):
    f = fleet
    s2 = f.sidecars[1]
    probe = chain()
    f.hold("replica-b", probe)
    subject = lambda peer: f"{f.name}.routes.{peer}"  # noqa: E731
    before = _metrics(s2)
    publish(f.nats.port, [
        # s1's subject, another peer in the body; and the reverse.
        (subject("s1"), _routed("s3", 1, 1, 1)),
        (subject("s3"), _routed("s1", 2**62, 1, 1)),
        # s1's name and subject, an epoch older than its real one (the start's ns).
        (subject("s1"), _routed("s1", 1, 10**9, 2)),
        # Garbage, another version, oversized.
        (subject("s1"), b"\x00\xffnot protobuf"),
        (subject("s1"), cachewire._field(1, 0, cachewire._varint(3)) + cachewire._string(2, "s1")),
        (subject("s1"), b" " * (6 * 1024 + 1)),
        # Not even a subject of a peer.
        (f"{f.name}.routes", _routed("s1", 1, 1, 3)),
    ])

    def dropped(reason):
        key = f'inferencecache_fleet_messages_dropped_total{{reason="{reason}"}}'
        return _metrics(s2)[key] - before[key]

    wait_until(lambda: dropped("peer_mismatch") == 2 and dropped("stale_epoch") == 1
               and dropped("malformed") == 1 and dropped("foreign_version") == 1
               and dropped("oversized") == 1,
               timeout=TIMEOUT, what="every forged or garbage message counted as dropped")
    b = _replica(s2, "replica-b")
    assert b["peerInflightRequests"] == 0 and b["peerInflightTokens"] == 0, b
    assert _fleet(s2)["peers"] == 1
    assert not _spills_for_s2(f, probe)
