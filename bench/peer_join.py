#!/usr/bin/env python3
"""Puts the llama.cpp peer's figures beside bench/moe_layer's rows of the same call.

  bench/peer_join.py RECORD_MD LLAMA_PEER_MD [--section=NAME] [--mode=ours]

RECORD_MD: moe_layer's markdown (scripts/bench_record.sh's record.md; with
--section, only the tables after the "## NAME" heading up to the next one).
LLAMA_PEER_MD: ../shared/peers/llama/peer.sh's llama_peer.md on the same
geometry (Qwen3-30B-A3B, same layers). For every moe_layer row whose T the peer
measured — T = 1 from llama-bench's tg32 (one sequence; rows with the
experts on the CPU, -ot exps=CPU, only), T = 8 / 32 from
llama-batched-bench (B sequences: a step is B / S_TG), prompts of 512 / 2048
tokens from llama-bench's pp (the best of its ubatches) — it prints the
mode's step (--mode, default ours: the worker's defaults), the
causal floor, llama.cpp's step, llama.cpp / ours, and llama.cpp / floor: the
speed-up the floor would allow, so a row is held to ">= 1.5x llama.cpp" only
where that column is >= 1.5. Exits 2 on unreadable input; never guesses a row.
"""
import re
import sys

NUM = re.compile(r"[-+]?\d+(?:\.\d+)?")


def first_number(cell):
    m = NUM.search(cell)
    return float(m.group()) if m else None


def md_tables(lines):
    """Yields (header cells, [row cells]) of each markdown table in lines."""
    table = []
    for line in lines + [""]:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif table:
            if len(table) >= 2:
                yield table[0], [r for r in table[2:] if len(r) == len(table[0])]
            table = []


def peer_steps(lines):
    """llama.cpp's ms per step by (T, is_prompt)."""
    steps = {}
    for head, rows in md_tables(lines):
        if "test" in head and "t/s" in head:  # llama-bench
            if "ot" not in head:  # every weight on the GPU: not the offload being compared
                continue
            ti, si, oi = head.index("test"), head.index("t/s"), head.index("ot")
            for r in rows:
                m = re.fullmatch(r"(tg|pp)(\d+)", r[ti])
                if "exps=CPU" not in r[oi]:
                    continue
                tps = first_number(r[si])
                if not m or not tps:
                    continue
                n = int(m.group(2))
                key = (1, False) if m.group(1) == "tg" else (n, True)
                ms = 1000.0 / tps if m.group(1) == "tg" else 1000.0 * n / tps
                steps[key] = min(ms, steps.get(key, float("inf")))
        elif "B" in head and "S_TG t/s" in head:  # llama-batched-bench
            bi, si = head.index("B"), head.index("S_TG t/s")
            for r in rows:
                b, tps = first_number(r[bi]), first_number(r[si])
                if b and tps and int(b) > 1:
                    steps[(int(b), False)] = 1000.0 * b / tps
    return steps


def our_rows(lines, mode):
    """moe_layer's (T, cache, step ms, causal floor ms) rows of `mode`."""
    out = []
    for head, rows in md_tables(lines):
        if not {"T", "cache", "mode", "step ms", "causal floor ms"} <= set(head):
            continue
        col = {h: i for i, h in enumerate(head)}
        for r in rows:
            t, step = first_number(r[col["T"]]), first_number(r[col["step ms"]])
            if r[col["mode"]] == mode and t is not None and step is not None:
                out.append((int(t), r[col["cache"]], step, first_number(r[col["causal floor ms"]])))
    return out


def main(argv):
    args = [a for a in argv[1:] if not a.startswith("--")]
    opts = dict(a[2:].split("=", 1) for a in argv[1:] if a.startswith("--") and "=" in a)
    section, mode = opts.get("section"), opts.get("mode", "ours")
    if len(args) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    try:
        record = open(args[0]).read().splitlines()
        peer = open(args[1]).read().splitlines()
    except OSError as e:
        print(f"peer_join: {e}", file=sys.stderr)
        return 2
    if section:
        start = next((i for i, l in enumerate(record) if l.startswith(f"## {section}")), None)
        if start is None:
            print(f"peer_join: no section '## {section}' in {args[0]}", file=sys.stderr)
            return 2
        end = next((i for i in range(start + 1, len(record)) if record[i].startswith("## ")), len(record))
        record = record[start:end]
    steps, rows = peer_steps(peer), our_rows(record, mode)
    if not steps or not rows:
        print(f"peer_join: no {'peer figures' if not steps else 'moe_layer rows'} found", file=sys.stderr)
        return 2
    print(f"| T | cache | {mode} ms | causal floor ms | llama.cpp ms | llama.cpp / ours | llama.cpp / floor |")
    print("|---|---|---|---|---|---|---|")
    for t, cache, ours, floor in rows:
        llama = steps.get((t, t >= 128))
        if llama is None:
            continue
        fl = f"{floor:.3f}" if floor else "-"
        allow = f"{llama / floor:.2f}" if floor else "-"
        print(f"| {t} | {cache} | {ours:.3f} | {fl} | {llama:.3f} | {llama / ours:.2f} | {allow} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
