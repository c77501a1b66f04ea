#!/usr/bin/env python3
"""The session options are documented where users read them: checks that the
keys moe_session_open accepts (c_api/moe_c_api.cc: key == "..."), the list in
include/moe/moe.h's moe_session_open comment and the Python Session docstring
(python/moe_expert_service/session.py) name the same options. Exit 1 with the
differences; 0 when they agree.

  python3 scripts/check_option_docs.py [REPO_ROOT]
"""
import ast
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def read(path):
    with open(os.path.join(root, path)) as f:
        return f.read()


# Accepted: every key the C ABI's option parser compares against.
accepted = set(re.findall(r'key == "([a-z_0-9]+)"', read("c_api/moe_c_api.cc")))

# moe.h: the comment block above moe_session_open. Documented keys are the
# quoted names that open an option line (` *   "key"`), with the names listed
# after them on that line ("a", "b" / or "c").
header = read("include/moe/moe.h")
block = header[:header.index("MOE_API moe_status moe_session_open(")]
block = block[block.rindex("/*"):]
documented, mentioned = set(), set(re.findall(r'"([a-z_0-9]+)"', block))
for line in block.splitlines():
    m = re.match(r'\s*\*\s+((?:"[a-z_0-9]+"(?:,\s*|\s+or\s+)?)+)', line)
    if m:
        documented |= set(re.findall(r'"([a-z_0-9]+)"', m.group(1)))
# ... and a second key named on the line after its first, e.g. `or "cache_gib"`.
documented |= {k for k in re.findall(r'\bor "([a-z_0-9]+)"', block)}

# Python: the Session class docstring.
tree = ast.parse(read("python/moe_expert_service/session.py"))
doc = next(ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Session")
python_words = set(re.findall(r"[a-z_0-9]+", doc))

problems = []
for key in sorted(accepted - mentioned):
    problems.append(f"moe.h does not document option {key!r}, which moe_session_open accepts")
for key in sorted(documented - accepted):
    problems.append(f"moe.h documents option {key!r}, which moe_session_open does not accept")
for key in sorted(accepted - python_words):
    problems.append(f"the Python Session docstring does not name option {key!r}")
if not accepted or not documented:
    problems.append("no options found: the parser or the header changed shape")
for p in problems:
    print(p)
print(f"{len(accepted)} options; {'agree' if not problems else f'{len(problems)} problem(s)'}")
sys.exit(1 if problems else 0)
