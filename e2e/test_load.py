"""The load rule through a real Envoy (issue 10): an overloaded holder spills with
x-inferencecache-spilled-from, and in-flight counts are released after responses."""

import concurrent.futures

import requests

from conftest import wait_until
from test_routing import chain, chain_headers, hold


def _inflight(stack):
    snap = requests.get(f"{stack.sidecar.admin}/snapshot", timeout=2).json()
    return {r["replicaId"]: r["inflightRequests"] for r in snap["replicas"]}


def test_an_overloaded_holder_spills_and_in_flight_is_released(override_host_stack):
    s = override_host_stack
    hashes = chain()
    hold(s, "replica-b", hashes)
    headers = dict(chain_headers(hashes), **{"x-test-hold-ms": "1500"})

    def one(_):
        return s.envoy.get(headers)

    with concurrent.futures.ThreadPoolExecutor(max_workers=12) as pool:
        futures = [pool.submit(one, i) for i in range(12)]
        # While the responses are held, the sidecar counts them where it sent them.
        wait_until(lambda: sum(_inflight(s).values()) == 12, timeout=5,
                   what="12 requests in flight")
        during = _inflight(s)
        replies = [f.result() for f in futures]

    assert all(r.status_code == 200 for r in replies), [r.status_code for r in replies]
    assert all(r.headers["x-inferencecache-reason"] == "PREFIX_MATCH" for r in replies)
    spilled = [r for r in replies if "x-inferencecache-spilled-from" in r.headers]
    stayed = [r for r in replies if "x-inferencecache-spilled-from" not in r.headers]
    # 3 replicas: the holder takes requests up to 1.25 x mean + 2, the rest spill.
    assert stayed and spilled, during
    assert all(r.text == "replica-b" for r in stayed)
    for r in spilled:
        assert r.headers["x-inferencecache-spilled-from"] == "replica-b"
        assert r.text != "replica-b"
        assert r.headers["x-inferencecache-replica"] == r.text
        assert r.headers["x-upstream-saw-spilled-from"] == "replica-b"
    assert during["replica-b"] < 12
    # Released on the response headers: nothing stays in flight.
    wait_until(lambda: sum(_inflight(s).values()) == 0, timeout=5,
               what="in-flight counts released")
    # Balanced again: the holder, no spill.
    r = s.envoy.get(chain_headers(hashes))
    assert r.text == "replica-b"
    assert "x-inferencecache-spilled-from" not in r.headers


def test_a_client_cannot_forge_the_spilled_from_header(override_host_stack):
    s = override_host_stack
    hashes = chain()
    hold(s, "replica-a", hashes)
    h = dict(chain_headers(hashes, debug=False), **{"x-inferencecache-spilled-from": "replica-c"})
    r = s.envoy.get(h)
    assert r.text == "replica-a"
    assert r.headers["x-upstream-saw-spilled-from"] == ""


def _replica(stack, replica):
    snap = requests.get(f"{stack.sidecar.admin}/snapshot", timeout=2).json()
    return next(r for r in snap["replicas"] if r["replicaId"] == replica)


def test_a_prefill_backlog_spills_and_goes_when_the_engine_stores_its_last_block(
        override_host_stack):
    s = override_host_stack
    probe = chain()
    hold(s, "replica-b", probe)
    # A long prompt whose first 64 tokens replica-b holds: it goes there with
    # 3000 uncached tokens of prefill, and its response is held for 4 s.
    big = chain(4)
    hold(s, "replica-b", big[:1])
    big_headers = dict(chain_headers(big), **{
        "x-inferencecache-block-token-counts": "64,1000,1000,1000",
        "x-test-hold-ms": "4000",
    })
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        held = pool.submit(s.envoy.get, big_headers)
        wait_until(lambda: _replica(s, "replica-b")["inflightTokens"] == 3000, timeout=5,
                   what="the long prompt's prefill counted on replica-b")
        # One request in flight is no count overload, but 3000 queued tokens
        # against an idle replica is: the probe's holder is skipped.
        r = s.envoy.get(chain_headers(probe))
        assert r.headers["x-inferencecache-reason"] == "PREFIX_MATCH"
        assert r.headers.get("x-inferencecache-spilled-from") == "replica-b", dict(r.headers)
        assert r.text != "replica-b"
        # The engine stores the long prompt's blocks: its prefill is over while its
        # response is still held, and the holder is the pick again.
        hold(s, "replica-b", big)
        wait_until(lambda: _replica(s, "replica-b")["inflightTokens"] == 0, timeout=5,
                   what="the backlog let go on BlockStored")
        assert _replica(s, "replica-b")["inflightRequests"] == 1
        r = s.envoy.get(chain_headers(probe))
        assert r.text == "replica-b"
        assert "x-inferencecache-spilled-from" not in r.headers
        assert held.result().status_code == 200
    wait_until(lambda: _replica(s, "replica-b")["inflightRequests"] == 0, timeout=5,
               what="the long prompt's request released")
