"""The package's layering, checked from the source: no import cycles (module-level or inside
functions), nothing imports a command, each room imports only the rooms the table below allows
(DESIGN.md, docs/design.md), the load generator reaches no engine code, and the product never
imports the benchmarks."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tinyllm_cli"
BENCHMARKS = PKG.parent / "benchmarks"

# The rooms (a top-level module, or a subpackage with everything in it) and the rooms each may
# import, anywhere in a file (module level or inside a function). An import across rooms that is
# not listed fails ``test_rooms_import_only_what_they_may``; a room not listed fails
# ``test_every_room_is_in_the_table``. Lower rooms first.
LEAVES = ("errors", "machine", "transfer", "version", "profiling", "report")
ROOMS: dict[str, set[str]] = {
    **{leaf: set() for leaf in LEAVES},
    "params": {"machine"},
    "kernels": {"machine"},
    "model": {"errors", "kernels", "machine"},
    "baselines": {"errors", "model"},
    "cache": {"errors", "kernels", "machine", "model", "transfer"},
    "engine": {"errors", "cache", "kernels", "machine", "model", "params", "transfer"},
    # config reads the cache's attention-path names and byte parser (inside functions).
    "config": {"errors", "params", "cache"},
    "io": {"errors", "engine", "model", "params"},
    "workload": {"errors", "engine", "io", "params"},
    "openai_batch": {"errors", "engine", "io", "params"},
    "runtime": {"errors", "cache", "config", "engine", "kernels", "machine", "model", "params", "transfer"},
    # The simulator sits below llm and cluster: whatever of theirs it needs is passed in.
    "sim": {"errors", "cache", "config", "engine", "machine", "model", "params", "runtime", "workload", "traces"},
    "cluster": {"errors", "config", "engine", "machine", "model", "params", "runtime"},
    "llm": {"errors", "cluster", "config", "engine", "io", "params", "runtime"},
    "serving": {"errors", "engine", "io", "openai_batch", "params", "version"},
    "roofline": {"kernels", "machine", "model"},
    "plot": {"errors", "report"},
    "__init__": {"config", "engine", "errors", "llm", "params"},
    "commands": {"baselines", "cache", "config", "engine", "errors", "io", "llm", "machine", "model", "openai_batch",
                 "params", "plot", "profiling", "report", "roofline", "runtime", "serving", "sim", "workload",
                 "loadgen", "traces"},
    "cli": {"cluster", "commands", "config", "errors", "io", "plot", "version", "workload", "loadgen"},
    "__main__": {"cli"},
    # The load generator and the trace format: clients of the HTTP API, no engine code.
    "traces": {"errors"},
    "loadgen": {"errors", "traces"},
}


# The load generator is a client of the HTTP API only (DESIGN.md, fourth round): nothing it
# reaches, directly or through any module it imports, is engine code.
ENGINE_CODE = ("tinyllm_cli.engine", "tinyllm_cli.cache", "tinyllm_cli.model", "tinyllm_cli.runtime",
               "tinyllm_cli.llm", "tinyllm_cli.cluster", "tinyllm_cli.sim")
HTTP_CLIENTS = ("tinyllm_cli.loadgen", "tinyllm_cli.commands.load", "tinyllm_cli.traces")


def room(module: str) -> str:
    """``tinyllm_cli.engine.scheduler`` -> ``engine``; ``tinyllm_cli`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def room_violations(g: dict[str, set[str]], rooms: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) for every import across rooms that the table does not allow."""
    return sorted((m, t) for m, ts in g.items() for t in ts
                  if room(m) != room(t) and room(t) not in rooms.get(room(m), set()))


def room_graph(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """Which room imports which (the summary the design notes draw)."""
    out: dict[str, set[str]] = {room(m): set() for m in g}
    for m, ts in g.items():
        out[room(m)] |= {room(t) for t in ts if room(t) != room(m)}
    return out


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
    assert "tinyllm_cli.engine.sampler" in g["tinyllm_cli.engine.runner"]  # `from . import sampler`
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


# The block pool holds no tensors (DESIGN.md, fourth round): the K/V storage is the runner's. The
# bookkeeping never reaches it, even indirectly; the scheduler, the engine loop and every module
# of the simulator never import it (the engine reaches it only through its default runner).
STORAGE = "tinyllm_cli.cache.storage"
BOOKKEEPING = ("tinyllm_cli.cache.allocator", "tinyllm_cli.cache.blocks", "tinyllm_cli.cache.block_keys",
               "tinyllm_cli.cache.snapshot")
NO_STORAGE_IMPORT = ("tinyllm_cli.engine.scheduler", "tinyllm_cli.engine.engine", "tinyllm_cli.sim")


def test_the_bookkeeping_and_the_simulator_never_import_the_storage():
    g = graph()
    assert STORAGE in g["tinyllm_cli.engine.runner"]  # the checker sees who does import it
    assert sorted(m for m in BOOKKEEPING if STORAGE in reachable(g, m)) == []
    users = [m for m in g if any(m == p or m.startswith(p + ".") for p in NO_STORAGE_IMPORT)]
    assert "tinyllm_cli.sim.engine" in users and "tinyllm_cli.sim.run" in users
    assert sorted(m for m in users if STORAGE in g[m]) == []


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
    """A worker (and what it loads there: the ISA probe, the site hook) runs under another engine's
    venv, where neither package is installed."""
    workers = sorted((BENCHMARKS / "workers").rglob("*.py"))
    assert {"llamacpp_worker.py", "openvino_worker.py", "vllm_worker.py", "sitecustomize.py"} <= {p.name for p in workers}
    bad = [p.name for p in workers if top_level_imports(p) & {"tinyllm_cli", "benchmarks"}]
    assert bad == []


def test_the_checker_sees_an_upward_import():
    g = {"tinyllm_cli.cache.blocks": {"tinyllm_cli.engine.request", "tinyllm_cli.model.llama"},
         "tinyllm_cli.engine.request": set(), "tinyllm_cli.model.llama": set()}
    assert room_violations(g, ROOMS) == [("tinyllm_cli.cache.blocks", "tinyllm_cli.engine.request")]
    assert room_graph(g)["cache"] == {"engine", "model"}


def test_every_room_is_in_the_table():
    assert sorted({room(m) for m in graph()} - set(ROOMS)) == []


def test_the_table_has_no_cycles():
    assert cycles(ROOMS) == []


def test_rooms_import_only_what_they_may():
    assert room_violations(graph(), ROOMS) == []
