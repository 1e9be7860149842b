#!/usr/bin/env python3
"""The routing benchmark's acceptance table over several seeds, from `inferencecache-sim bench-routing` runs.

Lay the runs out as DIR/LABEL-eENGINES-sSEED/results.json: one BASE label whose runs
have the comparison rows (round-robin, random, least-request, inferencecache-tuned,
oracle-load), and any number of variant labels whose runs have at least the
inferencecache row (a variant's own comparison rows win over the base's). For example:

    for s in 1 2 3; do for e in 4 8; do
      target/release/inferencecache-sim bench-routing --engines $e --seed $s \\
        --router round-robin --router random --router least-request \\
        --router inferencecache --router inferencecache-tuned --router oracle-load \\
        --out runs/base-e$e-s$s
    done; done
    python3 examples/demo/acceptance.py --dir runs base

Each cell is the median over seeds of that seed's ratio, with (passes/seeds); the last
table counts, per variant, the (workload, fleet) cells where most seeds meet a target
(all but shared-prefix's RR p50 ÷ ours ≥ 10, which no router meets under the batched
cost model; docs/benchmarks.md).
"""
import argparse
import glob
import json
import os
import statistics

WORKLOADS = ("shared-prefix", "multi-turn", "rag", "rag-hot")
LBS = ("round-robin", "random", "least-request")
# name, target, whether the value must be at least the target
CRITERIA = [("p50 ÷ best LB", 1.05, False), ("p90 ÷ best LB", 1.05, False),
            ("p99 ÷ best LB", 1.05, False), ("RR p50 ÷ ours", 10.0, True),
            ("throughput ÷ RR", 0.99, True), ("hit rate ÷ tuned", 0.95, True),
            ("max/mean", 1.3, False), ("p90 ÷ oracle-load", 1.2, False)]


def rows(path):
    return {(r["workload"], r["router"]): r for r in json.load(open(path))["runs"]}


def ratios(ours, get):
    best = lambda k: min(get(r)[k] for r in LBS)
    rr, tuned, oracle = get("round-robin"), get("inferencecache-tuned"), get("oracle-load")
    return [ours["ttft_p50_ms"] / best("ttft_p50_ms"), ours["ttft_p90_ms"] / best("ttft_p90_ms"),
            ours["ttft_p99_ms"] / best("ttft_p99_ms"), rr["ttft_p50_ms"] / ours["ttft_p50_ms"],
            ours["throughput_rps"] / rr["throughput_rps"], ours["hit_rate"] / tuned["hit_rate"],
            ours["imbalance"], ours["ttft_p90_ms"] / oracle["ttft_p90_ms"]]


def meets(i, x):
    _, target, at_least = CRITERIA[i]
    return x >= target if at_least else x <= target


def collect(root, label, base, engines):
    per = {}
    for path in sorted(glob.glob(f"{root}/{label}-e{engines}-s*/results.json")):
        seed = path.rsplit("-s", 1)[1].split("/")[0]
        base_path = f"{root}/{base}-e{engines}-s{seed}/results.json"
        if not os.path.exists(base_path):
            continue
        v, b = rows(path), rows(base_path)
        for wl in WORKLOADS:
            ours = v.get((wl, "inferencecache"))
            if ours:
                per.setdefault(wl, []).append(ratios(ours, lambda r: v.get((wl, r)) or b[(wl, r)]))
    return per


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="runs")
    ap.add_argument("--base", default="base")
    ap.add_argument("labels", nargs="+")
    args = ap.parse_args()
    summary = []
    for label in args.labels:
        counts, cells, full = [0] * len(CRITERIA), 0, 0
        for engines in (4, 8):
            per = collect(args.dir, label, args.base, engines)
            if not per:
                continue
            print(f"\n{label}: {engines} engines\n")
            print("| workload | " + " | ".join(c[0] for c in CRITERIA) + " |")
            print("|---" * (len(CRITERIA) + 1) + "|")
            for wl, seeds in per.items():
                out, all_ok = [], True
                for i in range(len(CRITERIA)):
                    xs = [s[i] for s in seeds]
                    passes = sum(meets(i, x) for x in xs)
                    if i == 3:  # shared-prefix only; not in the summary (no router meets it)
                        mark = " ✗" if wl == "shared-prefix" and not meets(i, statistics.median(xs)) else ""
                        tail = f" ({passes}/{len(xs)})" if wl == "shared-prefix" else ""
                        out.append(f"{statistics.median(xs):.2f}{mark}{tail}")
                        continue
                    ok = passes * 2 > len(xs)
                    counts[i] += ok
                    all_ok &= ok
                    mark = "" if meets(i, statistics.median(xs)) else " ✗"
                    out.append(f"{statistics.median(xs):.2f}{mark} ({passes}/{len(xs)})")
                cells += 1
                full += all_ok
                print(f"| {wl} | " + " | ".join(out) + " |")
        summary.append((label, counts, cells, full))
    names = [c[0] for i, c in enumerate(CRITERIA) if i != 3]
    print("\n| variant | " + " | ".join(names) + " | all |")
    print("|---" * (len(names) + 2) + "|")
    for label, counts, cells, full in summary:
        shown = [f"{c}/{cells}" for i, c in enumerate(counts) if i != 3]
        print(f"| {label} | " + " | ".join(shown) + f" | {full}/{cells} |")


if __name__ == "__main__":
    main()
