#!/usr/bin/env python3
"""Why a run's slow requests were slow, from `bench-routing --trace` files.

A RAG run's p90 is a cliff: a request either hits the cache (~10 ms) or prefills a
document, or waits behind one (~50-60 ms). This counts the slow requests of each
trace by cause, so two routers can be compared on what they do differently:

- first request of its document: nobody could have held it;
- sibling during the first prefill: the document's first request was still
  prefilling, so no engine reported holding it yet;
- later copy: the document was held somewhere, and the request went elsewhere
  (``spilled`` when inferencecache's load rule moved it);
- hit slowed: a cache hit that shared its engine with a cold prefill.

Spilled copies are also split by the load rule's check that moved them
(``spilled_by``: requests, share or prefill).

Usage: slow_causes.py TRACE.jsonl...   (prints one line per file and the medians)
"""

import json
import statistics
import sys

SLOW_MS = 20.0
CAUSES = ("first", "sibling", "copy", "copy_spilled", "hit_slowed")


def _cause(s, prompt_cached_min, first_done):
    family = s["family"]
    if s["cached_tokens"] >= prompt_cached_min:
        return "hit_slowed"
    if family not in first_done:
        first_done[family] = s["at_ms"] + s["ttft_ms"]
        return "first"
    if s["at_ms"] < first_done[family]:
        return "sibling"
    return "copy_spilled" if s.get("spilled_from") else "copy"


def copy_checks(samples, prompt_cached_min):
    """Slow spilled copies by the check that moved them (``spilled_by``)."""
    counts = {}
    first_done = {}
    for s in sorted(samples, key=lambda s: s["at_ms"]):
        cause = _cause(s, prompt_cached_min, first_done)
        if cause == "copy_spilled" and s["ttft_ms"] > SLOW_MS:
            check = s.get("spilled_by") or "unknown"
            counts[check] = counts.get(check, 0) + 1
    return counts


def causes(samples, prompt_cached_min):
    """Counts of each cause among `samples` (dicts of one trace line each).

    A request is a hit when the engine reported at least `prompt_cached_min`
    cached tokens (more than any prefix its document shares with the others).
    """
    counts = dict.fromkeys(CAUSES, 0)
    first_done = {}
    for s in sorted(samples, key=lambda s: s["at_ms"]):
        cause = _cause(s, prompt_cached_min, first_done)
        if s["ttft_ms"] > SLOW_MS:
            counts[cause] += 1
    return counts


def main(paths):
    if not paths:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    rows = []
    for path in paths:
        with open(path) as f:
            samples = [json.loads(line) for line in f if line.strip()]
        # A hit has more than half its prompt cached: more than the header every
        # RAG prompt shares (256 of 1,856 tokens), less than the document.
        half = min((s["prompt_tokens"] for s in samples), default=0) // 2
        c = causes(samples, half)
        checks = copy_checks(samples, half)
        rows.append((c, checks))
        by = "".join(f", {k} {v}" for k, v in sorted(checks.items()))
        print(f"{path}: " + ", ".join(f"{k} {v}" for k, v in c.items())
              + f"; slow {sum(c.values())}" + (f" (spilled copies by check{by[1:]})" if by else ""))
    if len(rows) > 1:
        med = {k: statistics.median(r[k] for r, _ in rows) for k in CAUSES}
        print("median: " + ", ".join(f"{k} {v:g}" for k, v in med.items()))
        names = sorted({k for _, ch in rows for k in ch})
        if names:
            print("median spilled copies by check: " + ", ".join(
                f"{k} {statistics.median(ch.get(k, 0) for _, ch in rows):g}" for k in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
