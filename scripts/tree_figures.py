"""Figures of a checkout's shape, read from its files (nothing is imported or run):

    python scripts/tree_figures.py DIR [DIR ...]          # one column per checkout
    python scripts/tree_figures.py ../wt-before . --graph  # and the request path's import graph

- the largest Python module of the package (``tinyllm_cli/``) and of the whole tree, in lines;
- the largest C++ file (``.cpp`` / ``.h`` / ``.hpp``);
- the lines of docs/performance.md and README.md;
- wide tuple returns across the engine / runner / cache seams (``tinyllm_cli/engine``,
  ``cache``, ``sim``, ``model`` and ``runtime.py``): functions that return a tuple literal of
  more than 3 elements, or are annotated as returning a tuple of more than 3 (ast-based);
- imports across rooms that ``ROOMS`` forbids, and import cycles, in the whole package;
- with ``--graph``: the import graph of a request's path, the ``generate`` command -> ``llm`` ->
  the runtime -> the engine loop -> the runner -> model and cache, at the level of rooms (as
  tests/test_structure.py's ``ROOMS`` of the tree this script lives in defines them) with every
  edge marked downward or not, then the modules inside the engine room on that path. Printed as
  a markdown table and a mermaid block, for docs/design.md.

Invariants:
- A checkout is judged by one yardstick: the room table and the room ranks come from this
  script's own tree, so an older checkout is measured against today's rule.
- An edge is downward when the room it points at ranks lower: a room's rank is one more than the
  highest rank of the rooms ``ROOMS`` lets it import (leaves rank 0).
- Results go to stdout; a directory that is not a tinyllm checkout is one sentence on stderr and
  exit 2.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SEAMS = ("tinyllm_cli/engine", "tinyllm_cli/cache", "tinyllm_cli/sim", "tinyllm_cli/model", "tinyllm_cli/runtime.py")
SKIP_DIRS = {".venv", ".git", "build", "node_modules", "__pycache__", ".pytest_cache"}
CPP_SUFFIXES = (".cpp", ".h", ".hpp", ".cc")
# A request's path, top to bottom: the module where each stop lives (the first that exists).
PATH_STOPS = {"generate command": ("tinyllm_cli.commands.generate",), "llm": ("tinyllm_cli.llm",),
              "runtime": ("tinyllm_cli.runtime",), "engine loop": ("tinyllm_cli.engine.engine",),
              "runner": ("tinyllm_cli.engine.runner", "tinyllm_cli.engine.engine")}
PATH_ROOMS = ("commands", "llm", "cluster", "runtime", "engine", "cache", "model", "kernels")


def files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    out = []
    for p in root.rglob("*"):
        if p.suffix in suffixes and p.is_file() and not (set(p.relative_to(root).parts[:-1]) & SKIP_DIRS):
            out.append(p)
    return sorted(out)


def lines(p: Path) -> int:
    return len(p.read_text(errors="replace").splitlines())


def largest(root: Path, paths: list[Path]) -> str:
    if not paths:
        return "-"
    p = max(paths, key=lines)
    return f"{p.relative_to(root)} ({lines(p):,})"


# ---- wide tuple returns ----------------------------------------------------------------------

def tuple_width(node: ast.expr | None) -> int:
    """Elements of a ``tuple[...]`` / ``Tuple[...]`` annotation (0 for anything else, and for
    the open ``tuple[X, ...]``); a quoted annotation is parsed first."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return 0
    if not (isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute))):
        return 0
    name = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
    if name not in ("tuple", "Tuple") or not isinstance(node.slice, ast.Tuple):
        return 0
    elts = node.slice.elts
    return 0 if any(isinstance(e, ast.Constant) and e.value is Ellipsis for e in elts) else len(elts)


def own_returns(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.Return]:
    """The function's own return statements (not those of functions or lambdas nested in it)."""
    out, todo = [], list(fn.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return):
            out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def wide_tuple_functions(path: Path, root: Path, wider_than: int = 3) -> list[str]:
    out = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        widths = [tuple_width(fn.returns)] + [len(r.value.elts) for r in own_returns(fn) if isinstance(r.value, ast.Tuple)]
        if max(widths) > wider_than:
            out.append(f"{path.relative_to(root)}:{fn.lineno} {fn.name} ({max(widths)})")
    return out


def seam_files(root: Path) -> list[Path]:
    out = []
    for seam in SEAMS:
        p = root / seam
        out += [p] if p.suffix == ".py" and p.is_file() else files(p, (".py",)) if p.is_dir() else []
    return out


# ---- the import graph ------------------------------------------------------------------------

def structure_module():
    """This tree's tests/test_structure.py: its ROOMS table and its import-graph reader."""
    spec = importlib.util.spec_from_file_location("_structure", HERE / "tests" / "test_structure.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ranks(rooms: dict[str, set[str]]) -> dict[str, int]:
    memo: dict[str, int] = {}

    def rank(r: str) -> int:
        if r not in memo:
            memo[r] = 1 + max((rank(t) for t in rooms.get(r, ())), default=-1)
        return memo[r]

    return {r: rank(r) for r in rooms}


def path_closure(g: dict[str, set[str]], st, start: str) -> set[str]:
    """The modules the ``generate`` command reaches that live in a room on the request's path."""
    return {m for m in st.reachable(g, start) | {start} if st.room(m) in PATH_ROOMS}


def room_edges(g: dict[str, set[str]], st, mods: set[str]) -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> the module pairs behind that edge, within ``mods``."""
    out: dict[tuple[str, str], list[str]] = {}
    for m in sorted(mods):
        for t in sorted(g[m] & mods):
            if st.room(m) != st.room(t):
                out.setdefault((st.room(m), st.room(t)), []).append(f"{short(m)}->{short(t)}")
    return out


def short(module: str) -> str:
    return module.removeprefix("tinyllm_cli.")


def graph_report(root: Path, st, rooms: dict[str, set[str]]) -> list[str]:
    g = st.graph(root / "tinyllm_cli")
    rank = ranks(rooms)
    mods = path_closure(g, st, "tinyllm_cli.commands.generate")
    edges = room_edges(g, st, mods)
    stops = {stop: next((m for m in cands if m in g), "-") for stop, cands in PATH_STOPS.items()}
    out = [f"### {root}: a request's path", "",
           "stops: " + ", ".join(f"{k} = {short(v)}" for k, v in stops.items()), "",
           "| room (rank) | imports (rank) | downward | module edges |", "|---|---|---|---|"]
    upward = 0
    for (a, b), pairs in sorted(edges.items(), key=lambda e: (-rank.get(e[0][0], 99), e[0][1])):
        down = rank.get(b, 99) < rank.get(a, -1) and b in rooms.get(a, set())
        upward += not down
        shown = ", ".join(pairs[:3]) + (f", +{len(pairs) - 3}" if len(pairs) > 3 else "")
        out.append(f"| {a} ({rank.get(a, '?')}) | {b} ({rank.get(b, '?')}) | {'yes' if down else 'NO'} | {shown} |")
    out += ["", f"edges not downward: {upward}", ""]
    out += engine_room_report(g, st, mods)
    out += ["", "```mermaid", "graph TD"]
    out += [f"  {a} --> {b}" for (a, b) in sorted(edges, key=lambda e: (-rank.get(e[0], 99), e[1]))]
    out += ["```", ""]
    return out


def engine_room_report(g: dict[str, set[str]], st, mods: set[str]) -> list[str]:
    """Inside the engine room: which module imports which, on the request's path."""
    inside = sorted(m for m in mods if st.room(m) == "engine")
    rows = ["engine room, module by module (on the path):", "", "| module | imports (engine room) |", "|---|---|"]
    for m in inside:
        rows.append(f"| {short(m)} | {', '.join(short(t) for t in sorted(g[m] & set(inside))) or '-'} |")
    loop, runner = "tinyllm_cli.engine.engine", "tinyllm_cli.engine.runner"
    if runner in g:
        back = loop in st.reachable(g, runner)
        rows += ["", f"runner reaches the engine loop: {'YES' if back else 'no'}"]
    return rows


# ---- the table -------------------------------------------------------------------------------

def figures(root: Path) -> dict[str, str]:
    py_pkg = files(root / "tinyllm_cli", (".py",))
    py_all = files(root, (".py",))
    cpp = files(root, CPP_SUFFIXES)
    wide = [w for p in seam_files(root) for w in wide_tuple_functions(p, root)]
    st = structure_module()
    g = st.graph(root / "tinyllm_cli")
    forbidden = st.room_violations(g, st.ROOMS)
    doc = {name: (f"{lines(root / name):,}" if (root / name).is_file() else "-") for name in ("docs/performance.md", "README.md")}
    return {"largest Python module (package)": largest(root, py_pkg),
            "largest Python module (tree)": largest(root, py_all),
            "largest C++ file": largest(root, cpp),
            "docs/performance.md lines": doc["docs/performance.md"],
            "README.md lines": doc["README.md"],
            "tuple returns wider than 3 (seams)": str(len(wide)),
            "imports across rooms that ROOMS forbids": str(len(forbidden)),
            "import cycles": str(len(st.cycles(g))),
            "_wide": wide, "_forbidden": [f"{short(a)} -> {short(b)}" for a, b in forbidden]}


def checkout(arg: str) -> Path:
    root = Path(arg).resolve()
    if not (root / "tinyllm_cli" / "__init__.py").is_file():
        print(f"tree_figures: {arg} is not a tinyllm checkout (no tinyllm_cli/__init__.py there)", file=sys.stderr)
        sys.exit(2)
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="checkout directories, one column each (e.g. before, after)")
    ap.add_argument("--graph", action="store_true", help="also the request path's import graph per checkout")
    ap.add_argument("--list", action="store_true", help="also list each wide tuple return and forbidden import")
    args = ap.parse_args()
    roots = [checkout(d) for d in args.dirs]
    figs = [figures(r) for r in roots]
    print("| figure | " + " | ".join(str(r) for r in roots) + " |")
    print("|---|" + "---|" * len(roots))
    for key in figs[0]:
        if not key.startswith("_"):
            print(f"| {key} | " + " | ".join(f[key] for f in figs) + " |")
    if args.list:
        for r, f in zip(roots, figs):
            print(f"\nwide tuple returns in {r}:")
            print("\n".join(f"- {w}" for w in f["_wide"]) or "- none")
            print(f"\nimports across rooms that ROOMS forbids in {r}:")
            print("\n".join(f"- {w}" for w in f["_forbidden"]) or "- none")
    if args.graph:
        st = structure_module()
        for r in roots:
            print()
            print("\n".join(graph_report(r, st, st.ROOMS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
