#!/usr/bin/env python3
"""One stats record: checks that moe::CallStats (include/moe/types.h), the C
ABI's moe_call_stats (include/moe/moe.h), the Python CallStats
(python/moe_expert_service/_lib.py) and the worker proto's LayerCallStats
(proto/moe/v1/worker.proto) have the same fields. Exit 1 naming the
differences.   python3 scripts/check_call_stats.py [REPO_ROOT]"""
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def block(path, start, end="}"):
    with open(os.path.join(root, path)) as f:
        text = f.read()
    i = text.index(start)
    return text[i + len(start):text.index(end, i)]


def fields(text, pattern):
    return set(re.findall(pattern, re.sub(r"(//|/\*|#).*", "", text)))


decl = r"^\s*(?:int|int64_t|uint64_t|double|uint32|uint64)\s+([a-z_]+)"
records = {
    "moe::CallStats (moe/types.h)": fields(block("include/moe/types.h", "struct CallStats {", "};"), re.compile(decl, re.M)),
    "moe_call_stats (moe/moe.h)": fields(block("include/moe/moe.h", "typedef struct moe_call_stats {", "}"), re.compile(decl, re.M)),
    "LayerCallStats (worker.proto)": fields(block("proto/moe/v1/worker.proto", "message LayerCallStats {"), re.compile(decl, re.M)),
    "CallStats (_lib.py)": set(re.findall(r'"([a-z_]+)"', block("python/moe_expert_service/_lib.py", "class CallStats(", "\n\n"))),
}
ref_name, ref = next(iter(records.items()))
problems = []
for name, got in records.items():
    if not got:
        problems.append(f"{name}: no fields found (the record changed shape)")
    for f in sorted(ref - got):
        problems.append(f"{name} lacks {f!r} of {ref_name}")
    for f in sorted(got - ref):
        problems.append(f"{name} has {f!r}, which {ref_name} does not")
for p in problems:
    print(p)
print(f"{len(ref)} fields; {'alike' if not problems else f'{len(problems)} problem(s)'}")
sys.exit(1 if problems else 0)
