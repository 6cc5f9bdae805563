"""The package's layering, checked from the source: no import cycles (module-level or inside
functions), nothing imports a command, the lower layers never reach up, and the product never
imports the benchmarks (DESIGN.md)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tinyllm_cli"
BENCHMARKS = PKG.parent / "benchmarks"

# Layers that must not import the ones named (by module prefix).
FORBIDDEN = {
    "tinyllm_cli.engine": ("tinyllm_cli.llm", "tinyllm_cli.cluster", "tinyllm_cli.runtime", "tinyllm_cli.io",
                           "tinyllm_cli.report", "tinyllm_cli.plot", "tinyllm_cli.workload", "tinyllm_cli.config"),
    "tinyllm_cli.cache": ("tinyllm_cli.engine", "tinyllm_cli.llm", "tinyllm_cli.cluster", "tinyllm_cli.runtime",
                          "tinyllm_cli.config", "tinyllm_cli.io"),
    "tinyllm_cli.model": ("tinyllm_cli.engine", "tinyllm_cli.cache", "tinyllm_cli.llm", "tinyllm_cli.cluster",
                          "tinyllm_cli.runtime", "tinyllm_cli.config", "tinyllm_cli.io"),
    "tinyllm_cli.cluster": ("tinyllm_cli.llm",),
    "tinyllm_cli.runtime": ("tinyllm_cli.llm", "tinyllm_cli.cluster"),
    "tinyllm_cli.report": ("tinyllm_cli.llm", "tinyllm_cli.engine", "tinyllm_cli.cluster"),
    # The server is a client of the engine contract: it is handed an engine, never builds one.
    "tinyllm_cli.serving": ("tinyllm_cli.llm", "tinyllm_cli.cluster", "tinyllm_cli.runtime", "tinyllm_cli.model",
                            "tinyllm_cli.cache", "tinyllm_cli.sim", "tinyllm_cli.engine.engine",
                            "tinyllm_cli.engine.scheduler"),
}
# Nothing below the server knows it exists.
for _low in ("tinyllm_cli.engine", "tinyllm_cli.cache", "tinyllm_cli.model", "tinyllm_cli.cluster",
             "tinyllm_cli.runtime", "tinyllm_cli.llm"):
    FORBIDDEN[_low] = FORBIDDEN.get(_low, ()) + ("tinyllm_cli.serving",)

# The load generator is a client of the HTTP API only (DESIGN.md, fourth round): nothing it
# reaches, directly or through any module it imports, is engine code.
ENGINE_CODE = ("tinyllm_cli.engine", "tinyllm_cli.cache", "tinyllm_cli.model", "tinyllm_cli.runtime",
               "tinyllm_cli.llm", "tinyllm_cli.cluster", "tinyllm_cli.sim")
HTTP_CLIENTS = ("tinyllm_cli.loadgen", "tinyllm_cli.commands.load", "tinyllm_cli.traces")


def module_name(path: Path, pkg: Path = PKG) -> str:
    parts = path.relative_to(pkg.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(pkg: Path = PKG) -> dict[str, Path]:
    return {module_name(p, pkg): p for p in pkg.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of ``name``'s own package that it imports, anywhere in the file."""
    top = name.split(".")[0]
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == top}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != top:
                continue
            for a in node.names:  # `from .engine import sampler` imports a module
                sub = f"{target}.{a.name}"
                out.add(sub if sub in known else target)
    return {m for m in out if m in known and m != name}


def graph(pkg: Path = PKG) -> dict[str, set[str]]:
    mods = modules(pkg)
    return {n: imports_of(n, p, set(mods)) for n, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in g:
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert cycles(g) == [["a", "b", "c"]]


def test_the_checker_resolves_relative_imports(tmp_path):
    g = graph()
    assert "tinyllm_cli.engine.contract" in g["tinyllm_cli.engine.engine"]
    assert "tinyllm_cli.engine.sampler" in g["tinyllm_cli.engine.engine"]  # `from . import sampler`
    assert "tinyllm_cli.llm" in g["tinyllm_cli.commands.common"]


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_no_import_cycles_in_the_benchmarks():
    g = graph(BENCHMARKS)
    assert "benchmarks.engines.llamacpp" in g["benchmarks.runs"]  # the checker sees relative imports there
    assert cycles(g) == []


def test_nothing_imports_a_command():
    g = graph()
    bad = [(m, t) for m, ts in g.items() for t in ts
           if t.startswith("tinyllm_cli.commands") and not (m == "tinyllm_cli.cli" or m.startswith("tinyllm_cli.commands"))]
    assert bad == []


def test_lower_layers_never_reach_up():
    g = graph()
    bad = [(m, t) for m, ts in g.items() for t in ts for layer, banned in FORBIDDEN.items()
           if (m == layer or m.startswith(layer + ".")) and any(t == b or t.startswith(b + ".") for b in banned)]
    assert bad == []


def reachable(g: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (a package's __init__ included)."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for t in g.get(m, ()):
            parents = [".".join(t.split(".")[:i]) for i in range(2, t.count(".") + 1)]
            for x in [t, *parents]:
                if x in g and x not in seen:
                    seen.add(x)
                    todo.append(x)
    return seen


def test_the_closure_sees_an_indirect_import():
    g = graph()
    assert "tinyllm_cli.engine.request" in reachable(g, "tinyllm_cli.workload")  # workload -> engine.request


def test_the_load_generator_reaches_no_engine_code():
    g = graph()
    clients = [m for m in g if any(m == c or m.startswith(c + ".") for c in HTTP_CLIENTS)]
    assert "tinyllm_cli.loadgen.run" in clients and "tinyllm_cli.commands.load" in clients
    bad = sorted((m, t) for m in clients for t in reachable(g, m)
                 if any(t == e or t.startswith(e + ".") for e in ENGINE_CODE))
    assert bad == []


def top_level_imports(path: Path) -> set[str]:
    """The first component of every absolute module a file imports, anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_product_never_imports_the_benchmarks():
    """Benchmarks are not the product: the cross-engine comparison lives in benchmarks/, which
    imports tinyllm_cli, never the other way."""
    assert (BENCHMARKS / "compare.py").is_file()  # the check looks where the benchmarks are
    assert "tinyllm_cli" in top_level_imports(BENCHMARKS / "engines" / "tinyllm.py")  # it sees imports
    bad = sorted(str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py") if "benchmarks" in top_level_imports(p))
    assert bad == []


def test_the_benchmark_workers_import_neither_package():
    """A worker runs under another engine's venv, where neither package is installed."""
    workers = sorted((BENCHMARKS / "workers").glob("*.py"))
    assert len(workers) == 3
    bad = [p.name for p in workers if top_level_imports(p) & {"tinyllm_cli", "benchmarks"}]
    assert bad == []
