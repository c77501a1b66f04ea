#!/usr/bin/env python3
"""The cache replay table of bench/RESULTS.md: every cell of the shared traces (each model's own
expert bytes; caches of 25/50%, device steps of 100/25 ms, batch 1 and 8) through bench/cache_replay,
printed as one markdown table. `default` against the best online policy (lru, lfu, lfru, coordinator,
best-so-far) by modelled step time and by hit rate, and against hindsight's best-static and the oracle.

  python3 bench/replay_table.py [--replay build/bench/cache_replay] [--traces ../shared/data/traces]
Exit 1 if a cell cannot be run or parsed.
"""
import argparse
import os
import subprocess
import sys

# Each trace's model: bytes of one bf16 expert (3 x H x I x 2).
TRACES = [
    ("olmoe-1b-7b-decode", 3 * 2048 * 1024 * 2),
    ("mixtral-8x7b-humaneval", 3 * 4096 * 14336 * 2),
    ("kimi-linear-48b-decode", 3 * 2304 * 1024 * 2),
]
ONLINE = ["lru", "lfu", "lfru", "coordinator", "best-so-far"]
POLICIES = ["default"] + ONLINE + ["best-static", "oracle"]


def cell(replay, path, batch, cache, step, expert_bytes):
    out = subprocess.run([replay, "--trace", path, "--cache", f"{cache}%", "--step-ms", str(step), "--batch",
                          str(batch), "--expert-bytes", str(expert_bytes), "--policies", ",".join(POLICIES)],
                         capture_output=True, text=True, check=True).stdout
    rows = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 5 and f[0] in POLICIES and f[1].endswith("%"):
            rows[f[0]] = (float(f[1].rstrip("%")), float(f[3]))  # hit rate %, step ms
    missing = [p for p in POLICIES if p not in rows]
    if missing:
        raise RuntimeError(f"{path} batch {batch} {cache}% {step} ms: no row for {missing}")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replay", default="build/bench/cache_replay")
    ap.add_argument("--traces", default="../shared/data/traces")
    a = ap.parse_args()
    print("| trace | batch | cache | step | default hit / ms | best online by step | best online by hits | "
          "best-static | default / best-static (step) | oracle |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    held = total = 0
    for name, expert_bytes in TRACES:
        path = os.path.join(a.traces, name + ".jsonl.xz")
        for batch in (1, 8):
            for cache in (25, 50):
                for step in (100, 25):
                    r = cell(a.replay, path, batch, cache, step, expert_bytes)
                    hit, ms = r["default"]
                    by_step = min(ONLINE, key=lambda p: r[p][1])
                    by_hits = max(ONLINE, key=lambda p: r[p][0])
                    slower = r[by_step][1] < ms
                    fewer = r[by_hits][0] > hit
                    total += 1
                    held += not slower and not fewer
                    bs_hit, bs_ms = r["best-static"]
                    o_hit, o_ms = r["oracle"]
                    print(f"| {name} | {batch} | {cache}% | {step} ms | {hit:.1f}% / {ms:.2f} | "
                          f"{by_step} {r[by_step][1]:.2f}{' **slower**' if slower else ''} | "
                          f"{by_hits} {r[by_hits][0]:.1f}%{' **more hits**' if fewer else ''} | "
                          f"{bs_hit:.1f}% / {bs_ms:.2f} | {ms / bs_ms:.3f} | {o_hit:.1f}% / {o_ms:.2f} |")
    print(f"\n`default` holds against every online policy on step and hits in {held} of {total} cells")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (subprocess.CalledProcessError, RuntimeError, OSError) as e:
        print(f"replay_table: {e}", file=sys.stderr)
        sys.exit(1)
