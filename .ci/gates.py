#!/usr/bin/env python3
"""CI gates on the code's shape (docs/architecture.md, "Shape rules"):

- no function over 120 lines (crates/, src/, sim/src; test folders and `tests.rs` files
  excepted);
- no source file over 1,000 lines (the same files);
- no import circle between modules that do not nest (a parent and its children may name each
  other; two siblings, or cousins, may not both depend on each other, directly or around a
  longer loop);
- no crate re-exports another of ours (`pub use ravnest_*`): its users name the crate that
  holds the item, so that what depends on what is what the imports say;
- no `use super::*` outside test code: a child module names what it takes from its parent.

Prints each breach with its place and exits 1 when there is one.
"""
import os
import re
import sys

ROOTS = ("crates", "src", "sim/src")
MAX_FN_LINES = 120
MAX_FILE_LINES = 1000


def rust_files():
    for root in ROOTS:
        for dp, _, fs in os.walk(root):
            if "/tests" in dp or dp.endswith("/benches") or "/target" in dp:
                continue
            for f in sorted(fs):
                # A module's unit tests in a file of their own are test code.
                if f.endswith(".rs") and f != "tests.rs":
                    yield os.path.join(dp, f)


def long_functions(path, lines):
    out, i = [], 0
    fn = re.compile(r"\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)")
    while i < len(lines):
        m = fn.match(lines[i])
        if m and not lines[i].rstrip().endswith(";"):
            depth, j, started = 0, i, False
            while j < len(lines):
                depth += lines[j].count("{") - lines[j].count("}")
                started = started or "{" in lines[j]
                if started and depth <= 0:
                    break
                j += 1
            if j - i + 1 > MAX_FN_LINES:
                out.append(f"{path}:{i + 1}: fn {m.group(6)} is {j - i + 1} lines (at most {MAX_FN_LINES})")
            i = j + 1
        else:
            i += 1
    return out


def crate_of(path):
    """(crate root folder, module path) of a source file."""
    parts = path.split("/")
    src = len(parts) - 1 - parts[::-1].index("src")
    root = "/".join(parts[: src + 1])
    rel = parts[src + 1 :]
    rel[-1] = rel[-1][:-3]
    if rel[-1] == "mod":
        rel = rel[:-1]
    if rel in (["lib"], ["main"]):
        rel = []
    return root, tuple(rel)


def code_only(text):
    text = re.sub(r"//[^\n]*", "", text)
    # Test modules may reach anywhere.
    cut = re.search(r"#\[cfg\(test\)\]\s*mod\s+tests", text)
    return text[: cut.start()] if cut else text


def references(module, text, known):
    """Modules of the same crate that `module`'s code names (the longest known prefix)."""
    refs = set()

    def resolve(base, names):
        path = list(base)
        best = None
        for n in names:
            path.append(n)
            if tuple(path) in known:
                best = tuple(path)
            else:
                break
        return best

    def expand(prefix_base, tail):
        # tail: "a::b::c" or "{a::x, b}" or "a::{x, y}"
        tail = tail.strip()
        if tail.startswith("{"):
            inner = tail[1 : tail.rfind("}")] if "}" in tail else tail[1:]
            depth, cur, items = 0, "", []
            for ch in inner:
                if ch == "," and depth == 0:
                    items.append(cur)
                    cur = ""
                    continue
                depth += ch == "{"
                depth -= ch == "}"
                cur += ch
            items.append(cur)
            for it in items:
                expand(prefix_base, it)
            return
        names = []
        for piece in re.split(r"::", tail):
            if piece.startswith("{"):
                r = resolve(prefix_base, names)
                expand(prefix_base + tuple(names), piece)
                if r:
                    refs.add(r)
                return
            m = re.match(r"\w+", piece)
            if not m:
                break
            names.append(m.group(0))
        r = resolve(prefix_base, names)
        if r:
            refs.add(r)

    tail_re = r"((?:\w+::)*(?:\{[^;]*?\}|\w+))"
    for m in re.finditer(r"\bcrate::" + tail_re, text):
        expand((), m.group(1))
    for m in re.finditer(r"\b((?:super::)+)" + tail_re, text):
        ups = m.group(1).count("super::")
        base = module[: len(module) - ups] if len(module) >= ups else ()
        expand(base, m.group(2))
    return refs


def nested(a, b):
    return a[: len(b)] == b or b[: len(a)] == a


def circles(files):
    by_crate = {}
    for p, text in files:
        root, module = crate_of(p)
        by_crate.setdefault(root, {})[module] = (p, text)
    out = []
    for root, mods in sorted(by_crate.items()):
        known = set(mods)
        edges = {}
        for module, (p, text) in mods.items():
            for r in references(module, code_only(text), known):
                if r != module and not nested(module, r):
                    edges.setdefault(module, set()).add(r)
        # Cycles: a depth-first search with colours; each back edge closes one.
        colour, stack, seen = {}, [], set()

        def visit(m):
            colour[m] = 1
            stack.append(m)
            for n in sorted(edges.get(m, ())):
                if colour.get(n) == 1:
                    loop = stack[stack.index(n) :] + [n]
                    key = frozenset(loop)
                    if key not in seen:
                        seen.add(key)
                        names = " -> ".join("::".join(x) or "(root)" for x in loop)
                        out.append(f"{root}: import circle {names}")
                elif colour.get(n) is None:
                    visit(n)
            stack.pop()
            colour[m] = 2

        for m in sorted(mods):
            if colour.get(m) is None:
                visit(m)
    return out


def in_tests(text, line_no):
    """Whether line `line_no` (1-based) is inside a `#[cfg(test)]` module of the file."""
    before = text.split("\n")[: line_no - 1]
    return any(l.strip() == "#[cfg(test)]" for l in before)


def main():
    files = [(p, open(p, errors="replace").read()) for p in rust_files()]
    breaches = []
    for p, text in files:
        lines = text.split("\n")
        breaches += long_functions(p, lines)
        if len(lines) - 1 > MAX_FILE_LINES:
            breaches.append(f"{p}: {len(lines) - 1} lines (at most {MAX_FILE_LINES}: split the module)")
    breaches += circles(files)
    for p, text in files:
        for i, line in enumerate(text.split("\n"), 1):
            m = re.match(r"\s*pub(\([^)]*\))? use (ravnest_\w+)", line)
            if m and not m.group(1):
                breaches.append(f"{p}:{i}: re-exports {m.group(2)} (name it where it is used)")
            if line.strip() == "use super::*;" and not in_tests(text, i):
                breaches.append(f"{p}:{i}: `use super::*` (name what the module takes)")
    for b in breaches:
        print(b)
    if breaches:
        print(f"{len(breaches)} shape rule(s) broken")
        return 1
    print(
        "shape rules hold: no function over 120 lines, no file over 1,000, no import circle, "
        "no re-export of another crate of ours, no `use super::*` outside tests"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
