"""The shipped Envoy configs under LLM-shaped load, and the routing header on fail-open.

2,000 concurrent streams, each held 9 s by the replica as a generation would be, go
through each shipped config with the sidecar deciding: every one must succeed and
Envoy must report no circuit-breaker overflow on the replicas cluster. With Envoy's
default breakers (1,024) the same run overflows. manifests/envoy-config.yaml is the
override-host config embedded (tests/manifests.rs keeps them equal).
"""

import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

import pytest
import requests

import loadgen
from conftest import MODEL, REPLICAS, SCHEME, TENANT, Envoy, Sidecar

HERE = pathlib.Path(__file__).resolve().parent
STREAMS = 2000
HOLD = 9.0    # seconds each response is held by the replica
RAMP = 5.0    # the streams are opened over this long (a burst, not a step: see burst.py)


class HeldReplica:
    def __init__(self, replica_id: str, port: int):
        self.replica_id = replica_id
        self.port = port
        self.address = f"127.0.0.1:{port}"


class HeldStack:
    """Held replicas (a process of their own), the sidecar and Envoy in one mode."""

    def __init__(self, mode: str, template: str, hold: float = HOLD):
        # Envoy holds a downstream and an upstream socket per stream, the replicas'
        # process and this one a socket per stream each.
        loadgen.raise_fd_limit(2 * STREAMS + 512)
        self.workdir = pathlib.Path(tempfile.mkdtemp(prefix="inferencecache-e2e-held-"))
        self.upstream_proc = subprocess.Popen(
            [sys.executable, str(HERE / "held_upstream.py"), "--hold", str(hold), *REPLICAS],
            stdout=subprocess.PIPE, text=True)
        ports = json.loads(self.upstream_proc.stdout.readline())
        self.upstreams = [HeldReplica(r, ports[r]) for r in REPLICAS]
        self.by_address = {u.address: u.replica_id for u in self.upstreams}
        self.sidecar = Sidecar(self.workdir, self.upstreams, mode)
        self.envoy = Envoy(self.workdir, template, self.sidecar, self.upstreams)

    def peak(self) -> dict:
        port = self.upstreams[0].port
        return requests.get(f"http://127.0.0.1:{port}/_peak", timeout=5).json()

    def close(self):
        self.envoy.stop()
        self.sidecar.stop()
        self.upstream_proc.kill()
        self.upstream_proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def headers_for(i: int) -> dict:
    """A distinct cold chain per stream: AFFINITY_HINT spreads them over the replicas."""
    base = (i + 1) << 32
    hashes = [base + k for k in range(4)]
    return {
        "x-inferencecache-tenant": TENANT,
        "x-inferencecache-model": MODEL,
        "x-inferencecache-hash-scheme": SCHEME,
        "x-inferencecache-block-hashes": ",".join(f"{x:x}" for x in hashes),
        "x-inferencecache-block-token-counts": "16,16,16,16",
    }


@pytest.mark.parametrize("mode,template", [
    ("override-host", "override-host.yaml"),
    ("original-dst", "original-dst.yaml"),
])
def test_two_thousand_held_streams_without_overflow(mode, template):
    stack = HeldStack(mode, template)
    try:
        started = time.monotonic()
        replies = loadgen.burst(stack.envoy.port, STREAMS, headers_for, ramp=RAMP,
                                timeout=HOLD + 30)
        wall = time.monotonic() - started
        stats = stack.envoy.stats("cluster.replicas.")
        everything = stack.envoy.stats()
        peak = stack.peak()
    finally:
        stack.close()

    errors = Counter(r.error or r.status for r in replies if r.error or r.status != 200)
    reasons = Counter(r.headers.get("x-upstream-saw-reason", "?") for r in replies)
    slowest = max(r.seconds for r in replies)
    print(f"{mode}: {STREAMS} streams in {wall:.1f}s, slowest {slowest:.2f}s, "
          f"peak held {peak['peak']}, reasons seen upstream {dict(reasons)}, "
          f"errors {dict(errors)}")
    notable = {k: v for k, v in everything.items() if v and any(
        w in k for w in ("overflow", "timeout", "5xx", "reset", "fail", "close_notify", "error"))}
    assert not errors, f"{dict(errors)} {notable}"
    assert stats["cluster.replicas.upstream_cx_overflow"] == 0, stats
    assert stats["cluster.replicas.upstream_rq_pending_overflow"] == 0, stats
    assert stats["cluster.replicas.upstream_rq_retry_overflow"] == 0, stats
    assert peak["served"] == STREAMS
    # The streams really were held together, not served in waves: (nearly) all of them
    # at once, far beyond Envoy's default breaker of 1,024. (A straggler that reaches
    # its replica after the first replies went out lowers the peak on a loaded machine.)
    assert peak["peak"] >= 0.95 * STREAMS, peak
    # Every reply came from the replica the routing header (if any) named.
    for r in replies:
        dest = r.headers["x-upstream-saw-destination"]
        if dest != "-":
            assert stack.by_address[dest] == r.body.decode(), (dest, r.body)
    if mode == "original-dst":
        assert "-" not in {r.headers["x-upstream-saw-destination"] for r in replies}


SPOOF_TARGET = "replica-c"


def spoofed(stack) -> dict:
    return {
        "x-gateway-destination-endpoint": stack.by_id[SPOOF_TARGET].address,
        "x-inferencecache-reason": "PREFIX_MATCH",
        "x-inferencecache-replica": SPOOF_TARGET,
        "x-inferencecache-score": "1.0000",
        "x-inferencecache-matched-tokens": "4096",
    }


def test_sidecar_header_reaches_the_upstream_and_the_clients_does_not(override_host_stack):
    s = override_host_stack
    for i in range(6):
        r = s.envoy.get({**headers_for(10_000 + i), **spoofed(s)})
        assert r.status_code == 200
        # The sidecar's pick (AFFINITY_HINT) is the header the replica sees, and the
        # replica that answered.
        assert r.headers["x-upstream-saw-reason"] == "AFFINITY_HINT"
        assert r.headers["x-upstream-saw-destination"] == s.by_id[r.text].address


def test_fail_open_strips_the_clients_routing_headers(override_host_stack):
    s = override_host_stack
    s.sidecar.stop()
    served = set()
    for i in range(6):
        r = s.envoy.get({**headers_for(20_000 + i), **spoofed(s)})
        assert r.status_code == 200, r.text
        served.add(r.text)
        # Nobody decided: the forged headers must not reach the replica.
        assert r.headers["x-upstream-saw-destination"] == "-"
        assert r.headers["x-upstream-saw-reason"] == ""
    assert len(served) > 1, "expected round-robin without the sidecar"
