"""Fail on any import circle among xdc's modules, TYPE_CHECKING imports included (a circle
that only the type checker follows still ties the two modules together for a reader).

Run on the installed layout (the view .ci/lint builds): ``python .ci/import_cycles.py VIEW``,
where VIEW/xdc is the package.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, following the view's symlinked subpackages."""
    out: dict[str, Path] = {}
    files = [
        Path(d) / n
        for d, _, names in os.walk(root / "xdc", followlinks=True)
        for n in names
        if n.endswith(".py")
    ]
    for f in files:
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports(name: str, f: Path, known: dict[str, Path]) -> set[str]:
    deps: set[str] = set()
    for n in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            if n.module in known:
                deps.add(n.module)
            deps.update(f"{n.module}.{a.name}" for a in n.names if f"{n.module}.{a.name}" in known)
        elif isinstance(n, ast.Import):
            deps.update(a.name for a in n.names if a.name in known)
    # a package's own __init__ importing its children is not a circle with them
    deps.discard(name)
    return {d for d in deps if not name.startswith(d + ".")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def main() -> int:
    root = Path(sys.argv[1])
    known = modules(root)
    if len(known) < 50:
        print(f"import_cycles: only {len(known)} modules under {root}/xdc: wrong view?")
        return 1
    graph = {name: imports(name, f, known) for name, f in known.items()}
    found = cycles(graph)
    for c in found:
        print("import circle: " + " <-> ".join(c))
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
