"""Smoke run of the routing benchmark (`inferencecache-sim bench-routing`).

A shrunken version of the README's demo: simulated engines, the sidecar and a real
Envoy, every router, every workload. It checks the harness end to end (the table,
results.json and the chart are produced, no request fails, the numbers are sane);
the full-size figures live in docs/benchmarks.md.
"""

import json
import subprocess

from conftest import envoy_binary, sidecar_binary, sim_binary

ROUTERS = ["round-robin", "random", "least-request", "inferencecache", "inferencecache-tuned", "oracle"]
WORKLOADS = ["shared-prefix", "multi-turn", "rag"]


def test_bench_routing_smoke(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sim_binary(),
            "bench-routing",
            "--envoy", envoy_binary(),
            "--sidecar", sidecar_binary(),
            "--engines", "2",
            "--shrink", "8",
            "--capacity-blocks", "384",
            "--out", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    for w in WORKLOADS:
        assert f"### {w}:" in proc.stdout, proc.stdout
    assert "inferencecache vs round-robin:" in proc.stdout
    assert "inferencecache-tuned vs round-robin:" in proc.stdout
    assert "of the oracle's hit rate" in proc.stdout

    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["workload"], r["router"]) for r in runs] == [
        (w, r) for w in WORKLOADS for r in ROUTERS
    ]
    for r in runs:
        label = f'{r["workload"]}/{r["router"]}'
        assert r["errors"] == 0, label
        assert r["requests"] > 0, label
        assert 0.0 <= r["hit_rate"] <= 1.0, label
        assert 0.0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] <= r["ttft_p99_ms"], label
        assert sum(r["per_engine"].values()) == r["requests"], label
        assert set(r["per_engine"]) == {"engine-0", "engine-1"}, label
        if r["router"].startswith("inferencecache"):
            # Every request was decided by the sidecar (debug header echoed).
            assert sum(r["reasons"].values()) == r["requests"], label
        else:
            assert r["reasons"] == {}, label

    by = {(r["workload"], r["router"]): r for r in runs}
    for w in WORKLOADS:
        # Repeated prefixes: the oracle always finds some of them cached.
        assert by[(w, "oracle")]["hit_rate"] > 0.2, w
        # Round-robin alternates between the two engines (per Envoy worker: 2).
        counts = by[(w, "round-robin")]["per_engine"].values()
        assert max(counts) - min(counts) <= 2, w

    svg = (out / "chart.svg").read_text()
    assert svg.startswith("<svg") and "TTFT CDF" in svg and "inferencecache" in svg
    assert "| inferencecache |" in (out / "results.md").read_text()
