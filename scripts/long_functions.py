#!/usr/bin/env python3
"""Lists function bodies longer than N lines (default 80) in the production
code (ROOTS: the layers of tests/layering_test.cc).
A function whose definition is directly preceded by a comment block with a
line starting with "// Long:" (the reason it stays whole) is allowed. With --check, exits 1
when any function is listed (the ctest Style.FunctionsShortOrExplained).

The scan is textual: a definition is a line ending with '{' whose signature
(that line and the lines above it back to the previous ';', '}', '{', ':' or
blank line: a signature may wrap) starts at indentation <= 2, is not a
control statement, class or namespace, and holds '('; its body ends where the
braces balance again."""
import os
import re
import sys

CONTROL = re.compile(r'^\s*(if|for|while|switch|else|do|try|catch|namespace|class|struct|enum|union|extern)\b')
ROOTS = ["core", "model", "transport", "process", "expert_compute", "gpu_worker", "expert_server", "coordinator",
         "client", "c_api"]


def strip(line):
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])*'", "''", line)
    return re.sub(r'//.*', '', line)


def long_functions(path, limit):
    lines = open(path, errors="replace").read().split("\n")
    found, i = [], 0
    while i < len(lines):
        s = strip(lines[i])
        if not s.rstrip().endswith("{") or CONTROL.match(s):
            i += 1
            continue
        start = i  # the signature may begin a few lines up (it wraps)
        while start > 0 and strip(lines[start - 1]).strip() and \
                not strip(lines[start - 1]).rstrip().endswith((";", "}", "{", ":")) and \
                not lines[start - 1].strip().startswith(("#", "//")):
            start -= 1
        first = strip(lines[start])
        signature = " ".join(strip(line) for line in lines[start:i + 1])
        # The signature's first line decides the indentation (a wrapped
        # signature's last line is indented under its parameters).
        is_def = (re.match(r"^( {0,2})\S", lines[start]) and not CONTROL.match(first) and "(" in signature
                  and "=" not in signature.split("(")[0])
        if not is_def:
            i += 1
            continue
        depth, k = 0, i
        while k < len(lines):
            t = strip(lines[k])
            depth += t.count("{") - t.count("}")
            if depth <= 0:
                break
            k += 1
        n = k - i + 1
        above = start - 1  # the comment block directly above the definition
        reason = False
        while above >= 0 and lines[above].strip().startswith("//"):
            reason |= lines[above].strip().startswith("// Long:")
            above -= 1
        if n > limit and not reason:
            found.append((n, f"{path}:{start + 1}", lines[start].strip()[:100]))
        i = k + 1 if n > 3 else i + 1
    return found


def main(argv):
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    limit = int(args[0]) if args else 80
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    found = []
    for top in ROOTS:
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for f in sorted(files):
                if f.endswith((".cc", ".cu", ".h")):
                    path = os.path.join(dirpath, f)
                    found += [(n, os.path.relpath(path, root) + loc[len(path):], sig)
                              for n, loc, sig in long_functions(path, limit)]
    for n, loc, sig in sorted(found, reverse=True):
        print(f"{n:4d} lines  {loc}  {sig}")
    if check and found:
        print(f"{len(found)} function(s) over {limit} lines without a '// Long:' reason above them")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
