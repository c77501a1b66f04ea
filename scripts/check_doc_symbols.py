#!/usr/bin/env python3
"""Checks that the code names the docs cite still exist in the code.

  scripts/check_doc_symbols.py [REPO_ROOT]      (exit 0: every name found; 1: stale names listed)

Citations come from every tracked Markdown file (backticked spans and fenced
code blocks; bench/history/ is a record of the past and is skipped) and from
the comments of every tracked C/C++ header. From them it takes what looks like
a code name:
  - qualified names `Foo::Bar` (each part must exist),
  - CamelCase identifiers with two or more capitals (`ExpertCache`,
    `PlanMisses`), or any capitalised identifier called as `Foo(`,
  - C ABI / metric names `moe_xxx`,
  - repository paths (`gpu_worker/planner.h`, `cuda/device_plan.cu`,
    `moe_session.cc`): a tracked file or folder, given from the root, from the
    citing file's folder, or as the tail of a tracked path.
A name exists when it appears as a whole word in the code with its comments
removed (C, C++, CUDA, Python, CMake, proto, shell, the deploy files), so a
name that survives only in another comment or doc still fails. Deliberate
exceptions (names of other projects, of things outside this repository) are
listed in scripts/doc_symbols_allowlist.txt, one per line with its reason.
Python 3 standard library only.
"""
import os
import re
import subprocess
import sys

SOURCE_EXT = (".h", ".hpp", ".cc", ".cpp", ".c", ".cu", ".cuh", ".py", ".proto", ".cmake", ".sh",
              ".in", ".yaml", ".yml", ".json", ".toml", ".txt")
SOURCE_NAMES = ("CMakeLists.txt", "Dockerfile")
C_LIKE = (".h", ".hpp", ".cc", ".cpp", ".c", ".cu", ".cuh", ".proto")
HASH_COMMENTS = (".py", ".cmake", ".sh", ".in", ".yaml", ".yml", ".toml", ".txt")

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
QUALIFIED = re.compile(rf"\b{IDENT}(?:::{IDENT})+")
CAMEL = re.compile(r"(?<![\w$/-])([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+)(?![\w/])")
CALLED = re.compile(r"(?<![\w$/-])([A-Z][A-Za-z0-9_]*[a-z][A-Za-z0-9_]*)\(")
MOE_C = re.compile(r"(?<![\w./-])(moe_[a-z0-9_]*[a-z0-9])(?![\w/.-])")
CODE_EXT = ("h", "hpp", "cc", "cpp", "c", "cu", "cuh", "py", "proto", "sh", "cmake")
PATH = re.compile(r"(?<![\w/-])(\.?/?(?:[A-Za-z0-9_.-]+/)*[A-Za-z0-9_-]+(?:\.[A-Za-z0-9]+)?/?)(?![\w/])")


def tracked_files(root):
    """Git's tracked files; outside a git checkout, the tree less hidden and build folders."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True, capture_output=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        found = []
        for d, subdirs, names in os.walk(root):
            subdirs[:] = [s for s in subdirs if not s.startswith((".", "build"))]
            found.extend(os.path.relpath(os.path.join(d, n), root) for n in names)
        return found


def strip_c_comments(text, keep_comments=False):
    """Returns (code without comments, [(line, comment text)])."""
    code, comments, i, n, line = [], [], 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "/" and i + 1 < n and text[i + 1] == "/":
            j = text.find("\n", i)
            j = n if j < 0 else j
            comments.append((line, text[i + 2:j]))
            i = j
        elif c == "/" and i + 1 < n and text[i + 1] == "*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j
            body = text[i + 2:j]
            comments.append((line, body))
            line += body.count("\n")
            code.append("\n" * body.count("\n"))
            i = j + 2
        elif c == '"' or c == "'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            code.append(text[i:j + 1])
            i = j + 1
        else:
            if c == "\n":
                line += 1
            code.append(c)
            i += 1
    return "".join(code), comments


def strip_hash_comments(text):
    # A '#' that starts a line or follows whitespace starts a comment (not in
    # "#experts=" inside strings, nor CMake's ${VAR}); good enough for a word index.
    return re.sub(r"(?m)(^|\s)#(?![!{]).*$", r"\1", text)


def source_words(root, files):
    words = set()
    for p in files:
        base = os.path.basename(p)
        if not (p.endswith(SOURCE_EXT) or base in SOURCE_NAMES) or p.startswith("bench/history/"):
            continue
        try:
            text = open(os.path.join(root, p), encoding="utf-8", errors="replace").read()
        except OSError:
            continue
        if p.endswith(C_LIKE):
            text = strip_c_comments(text)[0]
        elif p.endswith(HASH_COMMENTS) or base == "Dockerfile":
            text = strip_hash_comments(text)
        words.update(re.findall(IDENT, text))
    return words


def names_in(text):
    """The code names cited in `text`: (kind, name)."""
    found = []
    for m in QUALIFIED.finditer(text):
        found.append(("qualified", m.group(0)))
    scrubbed = QUALIFIED.sub(" ", text)
    for m in CAMEL.finditer(scrubbed):
        found.append(("name", m.group(1)))
    for m in CALLED.finditer(scrubbed):
        found.append(("name", m.group(1)))
    for m in MOE_C.finditer(text):
        found.append(("name", m.group(1)))
    for m in PATH.finditer(text):
        found.append(("path", m.group(1)))
    return found


def markdown_citations(text):
    """(line, text) pieces of a Markdown file that cite code: backticked spans and fenced blocks."""
    pieces, fence, line_no = [], None, 0
    for line_no, line in enumerate(text.split("\n"), 1):
        if re.match(r"\s*(```|~~~)", line):
            fence = None if fence else line.strip()[:3]
            continue
        if fence:
            pieces.append((line_no, line))
        else:
            pieces.extend((line_no, m.group(1)) for m in re.finditer(r"`([^`]+)`", line))
    return pieces


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
    files = tracked_files(root)
    tracked = set(files)
    dirs = {os.path.dirname(p) for p in files}
    for d in list(dirs):
        while d:
            dirs.add(d)
            d = os.path.dirname(d)
    words = source_words(root, files)
    allow_path = os.path.join(root, "scripts", "doc_symbols_allowlist.txt")
    allowed = set()
    if os.path.exists(allow_path):
        for raw in open(allow_path, encoding="utf-8"):
            entry = raw.split("#", 1)[0].strip()
            if entry:
                allowed.add(entry)

    top = {p.split("/", 1)[0] for p in files if "/" in p}

    def is_cited_path(p):
        # A repository path: under one of its top-level folders, or a bare file
        # name of source code (`moe_session.cc`). Anything else with a slash
        # (`gate/up`, `i/n`, `../shared/...`, `/run/moe/...`) is prose or outside.
        p = p[2:] if p.startswith("./") else p
        if "/" in p.rstrip("/"):
            return p.split("/", 1)[0] in top
        return "." in p[1:] and p.rsplit(".", 1)[1] in CODE_EXT

    def path_exists(p, citing):
        p = (p[2:] if p.startswith("./") else p).rstrip("/")
        if p in allowed or p in tracked or p in dirs:
            return True
        local = os.path.normpath(os.path.join(os.path.dirname(citing), p))
        if local in tracked or local in dirs:
            return True
        if any(t.endswith("/" + p) for t in tracked) or any(d.endswith("/" + p) for d in dirs):
            return True
        # A built binary named after its folder and target (`bench/moe_layer`).
        return "." not in os.path.basename(p) and os.path.basename(p) in words

    def name_exists(name):
        # A plural of a code name (`TensorInfos`) cites that name; a status
        # code named as prose (`InvalidArgument`) exists as absl's
        # InvalidArgumentError / StatusCode::kInvalidArgument.
        return (name in allowed or name in words or (name.endswith("s") and name[:-1] in words) or
                name + "Error" in words or "k" + name in words)

    sources = []
    for p in files:
        if p.startswith("bench/history/") or p.startswith("third_party/"):
            continue
        if p.endswith(".md"):
            text = open(os.path.join(root, p), encoding="utf-8", errors="replace").read()
            sources.extend((p, ln, piece) for ln, piece in markdown_citations(text))
        elif p.endswith((".h", ".cuh")):
            text = open(os.path.join(root, p), encoding="utf-8", errors="replace").read()
            sources.extend((p, ln, c) for ln, c in strip_c_comments(text)[1])

    stale = []
    for p, ln, piece in sources:
        for kind, name in names_in(piece):
            if kind == "path":
                ok = not is_cited_path(name) or path_exists(name, p)
            elif kind == "qualified":
                ok = name in allowed or all(name_exists(part) for part in name.split("::"))
            else:
                ok = name_exists(name)
            if not ok:
                stale.append(f"{p}:{ln}: `{name}` ({kind}) appears nowhere in the code")
    for s in sorted(set(stale)):
        print(s)
    if stale:
        print(f"check_doc_symbols: {len(set(stale))} cited names not found; fix the doc or comment, or list a "
              "deliberate exception with its reason in scripts/doc_symbols_allowlist.txt", file=sys.stderr)
        return 1
    print(f"check_doc_symbols: OK ({len(sources)} citations checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
