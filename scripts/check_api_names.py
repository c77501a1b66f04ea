#!/usr/bin/env python3
"""One name per concept on the three engine surfaces: checks that the C++
MoeSession (include/moe/engine.h, MoeSession and MoeSession::Admin), the C ABI
(include/moe/moe.h) and the Python Session (python/moe_expert_service/session.py)
name the same operations, and carry the same model-info fields, session
totals and option keys. Exit 1 with the differences; 0 when they agree.

Names are compared in snake case: C++ CamelCase becomes snake_case, the C
prefixes moe_session_ and moe_ are dropped, Python is taken as written (the
public methods and the attributes __init__ sets on Session, and the public
functions of session.py). A name missing from a surface must be listed, with
the surfaces it is on and a reason, in scripts/api_names_allowlist.txt; an
entry that no longer matches the code is reported too.

  python3 scripts/check_api_names.py [REPO_ROOT]
"""
import ast
import importlib
import os
import re
import sys

root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
SURFACES = ("c++", "c", "python")


def read(path):
    with open(os.path.join(root, path)) as f:
        return f.read()


def strip_comments(text):
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def braced(text, opener):
    """The text between the braces of the first `opener {` in text."""
    m = re.search(opener + r"\s*\{", text)
    if m is None:
        raise SystemExit(f"check_api_names: '{opener}' not found: the header changed shape")
    depth, i = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i - 1]


def collapse(text):
    """Nested {...} bodies reduced to {} (inline bodies, nested types, initialisers)."""
    while re.search(r"\{[^{}]*\}", text):
        text = re.sub(r"\{[^{}]*\}", "\0", text)  # innermost first, marked by a NUL
    return text.replace("\0", "{}")


def snake(name):
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


# ---- C++: the public methods of MoeSession and MoeSession::Admin ----------

def public_methods(body, cls):
    names, public = set(), False
    for stmt in re.split(r"[;}]", collapse(body)):
        for label in re.findall(r"\b(public|private|protected)\s*:", stmt):
            public = label == "public"
        stmt = re.sub(r".*\b(?:public|private|protected)\s*:", "", stmt, flags=re.S)
        m = re.search(r"(~?\b\w+)\s*\(", stmt)
        if not public or m is None or re.match(r"\s*(friend|struct|class|using)\b", stmt):
            continue
        name = m.group(1)
        if name.lstrip("~") == cls or name == "operator" or "operator" in stmt.split("(")[0]:
            continue
        names.add(snake(name))
    return names


engine = strip_comments(read("include/moe/engine.h"))
session_body = braced(engine, r"class MoeSession")
cpp_ops = public_methods(session_body, "MoeSession") | public_methods(braced(session_body, r"class Admin"), "Admin")


def struct_members(text, opener):
    """Member names of a C/C++ struct: the identifier before `=`, `[` or `;` of each declaration."""
    names = []
    body = collapse(braced(text, opener))
    while re.search(r"<[^<>]*>", body):  # template arguments hold commas and parentheses
        body = re.sub(r"<[^<>]*>", "", body)
    for stmt in body.split(";"):
        stmt = stmt.split("=")[0].strip()
        if not stmt or "(" in stmt:
            continue
        decl = re.sub(r"\[[^\]]*\]", "", stmt)
        head, _, rest = decl.partition(",")  # `int32_t a, b;`
        names.append(re.findall(r"\w+", head)[-1])
        names += [re.findall(r"\w+", part)[-1] for part in rest.split(",") if re.findall(r"\w+", part)]
    return names


def cpp_struct_members(text, opener):
    # `uint64_t calls = 0, failed_calls = 0;`: drop the initialisers first.
    body = re.sub(r"=\s*[^,;{}]+", "", collapse(braced(text, opener)))
    return struct_members("X {" + body + "}", "X")


types_h = strip_comments(read("include/moe/types.h"))

# ---- C: the moe_* functions and structs of moe.h ---------------------------

moe_h = strip_comments(read("include/moe/moe.h"))
c_functions = re.findall(r"MOE_API\s+[^;(]*?\b(moe_\w+)\s*\(", moe_h)
c_ops = {re.sub(r"^moe_(session_)?", "", f) for f in c_functions}

# ---- Python: Session's public methods and attributes, session.py's functions

session_py = ast.parse(read("python/moe_expert_service/session.py"))
py_ops = set()
for node in session_py.body:
    if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
        py_ops.add(node.name)
    if isinstance(node, ast.ClassDef) and node.name == "Session":
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                py_ops.add(item.name)
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                for sub in ast.walk(item):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and \
                            isinstance(sub.value, ast.Name) and sub.value.id == "self" and not sub.attr.startswith("_"):
                        py_ops.add(sub.attr)

# The Python records, from the package's own code (ctypes only: no libmoe.so is loaded).
sys.path.insert(0, os.path.join(root, "python"))
_lib = importlib.import_module("moe_expert_service._lib")
session_mod = importlib.import_module("moe_expert_service.session")
py_model_info = list(session_mod._model_info_dict(_lib.ModelInfo()))
py_totals = [name for name, _ in _lib.SessionTotals._fields_]

# ---- C++ SessionOptions vs the keys moe_session_open accepts ---------------

c_api = read("c_api/moe_c_api.cc")
option_keys = {
    "options": set(re.findall(r'\bkey == "(\w+)"', c_api)),
    "group": set(re.findall(r'it\.key\(\) == "(\w+)"', braced(c_api, r"absl::Status ParseGroup\([^)]*\)"))),
    "tls": set(re.findall(r'it\.key\(\) == "(\w+)"', braced(c_api, r"absl::Status ParseTls\([^)]*\)"))),
}
cpp_options = {
    "options": set(cpp_struct_members(engine, r"struct SessionOptions")),
    "group": set(cpp_struct_members(types_h, r"struct ParallelGroup")),
    "tls": set(cpp_struct_members(types_h, r"struct TlsOptions")),
}

# ---- compare --------------------------------------------------------------

allowed = {}  # (kind, name) -> surfaces it is on
for number, line in enumerate(read("scripts/api_names_allowlist.txt").splitlines(), 1):
    line = line.strip()
    if not line or line.startswith("#"):
        continue
    parts = line.split(None, 3)
    if len(parts) < 4 or any(s not in SURFACES for s in parts[2].split(",")):
        raise SystemExit(f"api_names_allowlist.txt:{number}: want 'KIND NAME SURFACES REASON', SURFACES of {SURFACES}")
    allowed[(parts[0], parts[1])] = set(parts[2].split(","))

problems, used = [], set()


def compare(kind, by_surface):
    names = set().union(*by_surface.values())
    for name in sorted(names):
        on = {s for s, got in by_surface.items() if name in got}
        if len(on) == len(by_surface):
            continue
        if allowed.get((kind, name)) == on:
            used.add((kind, name))
            continue
        missing = ", ".join(s for s in by_surface if s not in on)
        problems.append(f"{kind} {name!r}: on {', '.join(s for s in by_surface if s in on)}, not on {missing}"
                        + (f" (the allowlist says {','.join(sorted(allowed[(kind, name)]))})"
                           if (kind, name) in allowed else ""))


compare("operation", {"c++": cpp_ops, "c": c_ops, "python": py_ops})
compare("model_info", {"c++": set(cpp_struct_members(engine, r"struct ModelInfo")),
                       "c": set(struct_members(moe_h, r"typedef struct moe_model_info")),
                       "python": set(py_model_info)})
compare("totals", {"c++": set(cpp_struct_members(types_h, r"struct SessionTotals")),
                   "c": set(struct_members(moe_h, r"typedef struct moe_session_totals")),
                   "python": set(py_totals)})
for kind in option_keys:
    compare(f"{kind}_key", {"c++": cpp_options[kind], "c": option_keys[kind]})

for kind, name in sorted(set(allowed) - used):
    problems.append(f"allowlist: {kind} {name!r} is listed but not a difference (remove it)")
if not cpp_ops or not c_ops or not py_ops:
    problems.append("no operations found on a surface: a file changed shape")
for p in problems:
    print(p)
print(f"{len(cpp_ops | c_ops | py_ops)} operation names, {len(py_model_info)} model-info fields; "
      f"{'agree' if not problems else f'{len(problems)} problem(s)'}")
sys.exit(1 if problems else 0)
