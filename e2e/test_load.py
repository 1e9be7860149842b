"""The load rule through a real Envoy: an overloaded holder spills with
x-inferencecache-spilled-from, and in-flight counts are released after responses,
or at the end of the prefill when the engine's events and queue report are live; a
holder that took more than its share of the requests routed lately spills though
nothing is in flight there."""

import concurrent.futures

import requests

import cachewire
from conftest import MODEL, SCHEME, TENANT, wait_until
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
        assert r.headers["x-inferencecache-spilled-by"] == "requests"
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
    h = dict(chain_headers(hashes, debug=False), **{"x-inferencecache-spilled-from": "replica-c",
                                                     "x-inferencecache-spilled-by": "share"})
    r = s.envoy.get(h)
    assert r.text == "replica-a"
    assert r.headers["x-upstream-saw-spilled-from"] == ""
    assert r.headers["x-upstream-saw-spilled-by"] == ""


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
        assert r.headers.get("x-inferencecache-spilled-by") == "prefill", dict(r.headers)
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


def _open_streams(stack):
    text = requests.get(f"{stack.sidecar.admin}/metrics", timeout=2).text
    line = next(l for l in text.splitlines() if l.startswith("inferencecache_ext_proc_streams "))
    return float(line.split()[1])


def test_with_live_engine_signals_a_request_ends_with_its_prefill(override_host_stack):
    """serve --inflight-release prefill-end (the default): once replica-b's engine
    sends events and a queue report, a request there leaves the in-flight count
    when the engine stores its last block, and Envoy skips the response headers,
    so the ext_proc stream ends with the routing reply."""
    s = override_host_stack
    prefix = chain()
    hold(s, "replica-b", prefix)

    def routed_with_a_new_tail():
        full = prefix + chain(1)
        headers = dict(chain_headers(full, debug=False), **{"x-test-hold-ms": "3000"})
        return full, headers

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        # No queue report yet: the decode after the prefill would be invisible,
        # so the request counts until its response headers (the stream stays open).
        full, headers = routed_with_a_new_tail()
        held = pool.submit(s.envoy.get, headers)
        wait_until(lambda: _replica(s, "replica-b")["inflightRequests"] == 1, timeout=5,
                   what="the request counted on replica-b")
        hold(s, "replica-b", full)
        wait_until(lambda: _replica(s, "replica-b")["inflightTokens"] == 0, timeout=5,
                   what="its prefill backlog let go")
        assert _replica(s, "replica-b")["inflightRequests"] == 1
        assert _open_streams(s) == 1, "the stream waits for the response headers"
        assert held.result().text == "replica-b"
        wait_until(lambda: _replica(s, "replica-b")["inflightRequests"] == 0, timeout=5,
                   what="released on the response headers")

        # The engine's queue is reported (as its /metrics scrape would be).
        cachewire.report_stats(s.sidecar.ingest_addr, TENANT, MODEL, SCHEME, "replica-b",
                               token=s.sidecar.ingest_token)
        full, headers = routed_with_a_new_tail()
        held = pool.submit(s.envoy.get, headers)
        wait_until(lambda: _replica(s, "replica-b")["inflightRequests"] == 1, timeout=5,
                   what="the request counted on replica-b")
        # Envoy was told to skip the response headers: the stream is already over.
        # (Within 1 s: the response is held for 3 s.)
        wait_until(lambda: _open_streams(s) == 0, timeout=1, what="the ext_proc stream ended")
        hold(s, "replica-b", full)
        wait_until(lambda: _replica(s, "replica-b")["inflightRequests"] == 0, timeout=5,
                   what="released when the engine stored the last block")
        assert not held.done(), "released before the response, by the engine's event"
        metrics = requests.get(f"{s.sidecar.admin}/metrics", timeout=2).text
        assert 'inferencecache_inflight_prefill_ends_total{cause="event"} 1' in metrics
        r = held.result()
    assert r.status_code == 200
    assert r.text == "replica-b"
    assert r.headers["x-upstream-saw-reason"] == "PREFIX_MATCH"
    assert r.headers["x-upstream-saw-spilled-from"] == ""


def test_a_holder_over_its_share_spills_with_nothing_in_flight(override_host_stack):
    """One request at a time, so the request count never spills: the share bound
    (shareFactor 1.2 x mean + 2, once the mean of recent requests per replica is
    16 or more) moves the pick once replica-b has taken far more than its share,
    and AllBlocksCleared starts its count over."""
    s = override_host_stack
    hashes = chain()
    hold(s, "replica-b", hashes)
    replies = []
    for _ in range(60):
        r = s.envoy.get(chain_headers(hashes))
        assert r.status_code == 200, r.text
        replies.append(r)
    assert all(r.headers["x-inferencecache-reason"] == "PREFIX_MATCH" for r in replies)
    # A trickle (mean below 16 a replica: the first 46 of 3 replicas) is left alone.
    assert all(r.text == "replica-b" and "x-inferencecache-spilled-from" not in r.headers
               for r in replies[:40]), [r.text for r in replies[:40]]
    spilled = [r for r in replies if "x-inferencecache-spilled-from" in r.headers]
    assert spilled, [r.text for r in replies]
    for r in spilled:
        assert r.headers["x-inferencecache-spilled-from"] == "replica-b"
        assert r.headers["x-inferencecache-spilled-by"] == "share"
        assert r.text != "replica-b"
        assert r.headers["x-upstream-saw-spilled-from"] == "replica-b"
    assert sum(_inflight(s).values()) <= 1
    took = sum(r.text == "replica-b" for r in replies)
    recent = _replica(s, "replica-b")["recentRequests"]
    # Halving every 10 s: the count is what replica-b took, barely decayed.
    assert took * 0.7 <= recent <= took, (took, recent)
    out = cachewire.ingest(s.sidecar.ingest_addr, TENANT, MODEL, SCHEME, "replica-b",
                           [cachewire.cleared_event()], token=s.sidecar.ingest_token)
    assert out == {"applied": 1, "rejected": 0}
    assert _replica(s, "replica-b")["recentRequests"] == 0
