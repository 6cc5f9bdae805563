"""The docs cannot rot: what they show is run or parsed here.

- ``docs/python-api.md`` is a notebook: its ``python`` blocks run top to bottom in one namespace
  on the default model (tracebacks point at the .md file's own line numbers).
- Every ``tinyllm ...`` command line in README.md, docs/*.md and the kernels README (in
  ```bash / ```sh / ```console blocks, and inline `tinyllm ...` spans in the prose) is parsed by
  the real CLI parser without running it, and its settings are validated as the command would
  validate them (an all-caps value such as `--dtype DTYPE` is a placeholder: parsed, not validated);
  ``scripts/*.py`` and ``python -m benchmarks...`` lines are checked against their ``--help``,
  ``make`` lines against the Makefile, ``python -m tinyllm_cli...`` lines against the importable modules.
- The comparison tables of docs/performance.md and the README's summary are what
  ``python -m benchmarks.report`` renders from ``benchmarks/results``, so they cannot drift from the
  stored data; every table names its CPU and date; no session diary in the docs this suite owns.
- The README's examples run end to end at small sizes (the default model for generate and
  serve-batch, the tiny random checkpoint for bench and inspect-blocks), then ``plot`` on their
  JSON; the README's Python block runs too.
- Every flag of every command is documented in docs/commands.md; every relative link resolves;
  README.md stays at most 250 lines and keeps its two quickstart commands.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer.main

from tinyllm_cli import cli as cli_module
from tinyllm_cli.cli import main
from conftest import wait_s

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
KERNELS_README = ROOT / "tinyllm_cli" / "kernels" / "README.md"
DOC_FILES = [README, *DOCS, KERNELS_README]
NOTEBOOK = ROOT / "docs" / "python-api.md"
COMMANDS_MD = ROOT / "docs" / "commands.md"
SHELL_LANGS = {"bash", "sh", "shell", "console"}
COMMANDS = ("generate", "serve-batch", "bench", "inspect-blocks", "plot")


# ---- reading markdown -------------------------------------------------------------------------

@dataclass
class Block:
    lang: str
    body: str
    line: int  # line number of the block's first body line in its file


FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


def code_blocks(text: str) -> list[Block]:
    return [Block(m.group(1).lower(), m.group(2), text.count("\n", 0, m.start(2)) + 1) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced blocks (their lines blanked, so line numbers survive)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def inline_commands(text: str) -> list[tuple[int, str]]:
    """`tinyllm ...` spans in the prose (a span may run over a line break)."""
    body = prose(text)
    return [(body.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`(tinyllm(?:\s[^`]*)?)`", body)]


# ---- shell lines -> commands ------------------------------------------------------------------

@dataclass
class Command:
    argv: list[str]  # the program's arguments (without the program)
    kind: str  # "tinyllm", "script", "make", "module"
    line: int
    source: str
    program: str = ""
    env: dict = field(default_factory=dict)


SEPARATORS = {"|", "||", "&&", ";", "&", "|&"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "<<", ">|"}
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def logical_lines(body: str, console: bool) -> list[tuple[int, str]]:
    """(offset, line) with backslash continuations joined; console blocks keep only `$ ` lines."""
    out, buf, start = [], "", None
    for i, raw in enumerate(body.splitlines()):
        line = raw
        if buf == "":
            if console:
                if not line.lstrip().startswith("$ "):
                    continue
                line = line.lstrip()[2:]
            start = i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((start, buf + line))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def substitute(token: str, env: dict) -> str:
    """`$VAR` / `${VAR}`: the value set earlier in the block, else a neutral placeholder."""
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), "1"), token)


def commands_in_line(line: str, env: dict) -> list[tuple[str, list[str]]]:
    """Split a shell line into simple commands (pipes, &&, ;), drop redirections, comments and
    `...` elisions, and peel env-var prefixes off (remembering them for `$VAR`s)."""
    line = re.sub(r"(?<![\w$-])\d+(?=[<>])", "", line)  # the fd of `2>` / `2>&1`
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError as e:  # an unbalanced quote: a docs bug worth failing on
        raise AssertionError(f"cannot split shell line {line!r}: {e}")
    segments, seg = [], []
    for t in tokens:
        if t in SEPARATORS:
            segments.append(seg)
            seg = []
        else:
            seg.append(t)
    segments.append(seg)
    out = []
    for seg in segments:
        words, skip = [], False
        for t in seg:
            if skip:
                skip = False
            elif t in REDIRECTS:
                skip = True
            elif t != "...":
                words.append(t)
        while words and ENV.match(words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words and words[0] == "export":
            for w in words[1:]:
                if ENV.match(w):
                    name, _, value = w.partition("=")
                    env[name] = value
            continue
        if words and words[0] in ("time", "nice"):
            words = words[1:] if words[0] == "time" else words[3:]
        if words:
            out.append((words[0], [substitute(w, env) for w in words[1:]]))
    return out


def classify(program: str, args: list[str]) -> tuple[str, str, list[str]] | None:
    name = Path(program).name
    if name == "tinyllm":
        return "tinyllm", program, args
    if re.fullmatch(r"python[\d.]*", name):
        if args[:2] == ["-m", "tinyllm_cli"]:
            return "tinyllm", program, args[2:]
        if args[:1] == ["-m"] and len(args) > 1:
            return "module", args[1], args[2:]
        if args and args[0].startswith("scripts/") and args[0].endswith(".py"):
            return "script", args[0], args[1:]
        return None
    if name == "make":
        return "make", program, args
    if program.startswith("scripts/") and program.endswith(".py"):
        return "script", program, args
    return None


def shell_commands(path: Path | str) -> list[Command]:
    """The commands in a markdown file's shell blocks (or in markdown text)."""
    text = path.read_text() if isinstance(path, Path) else path
    out = []
    for b in code_blocks(text):
        if b.lang not in SHELL_LANGS:
            continue
        env: dict = {}
        for off, line in logical_lines(b.body, console=b.lang == "console"):
            for program, args in commands_in_line(line, env):
                c = classify(program, args)
                if c:
                    out.append(Command(c[2], c[0], b.line + off, line.strip(), c[1], dict(env)))
    return out


# ---- checking a tinyllm command line without running it ---------------------------------------

ROOT_CMD = typer.main.get_command(cli_module.app)
FUNCTIONS = {"generate": cli_module.generate, "serve": cli_module.serve, "serve-batch": cli_module.serve_batch,
             "bench": cli_module.bench, "inspect-blocks": cli_module.inspect_blocks, "plot": cli_module.plot_command,
             "simulate": cli_module.simulate, "load": cli_module.load}


def own_params(name: str) -> set[str]:
    """The command's own parameters (the rest are the shared options ``@shared`` added)."""
    return set(inspect.signature(FUNCTIONS[name].__wrapped__).parameters) - {"opts"}


PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*[A-Z]")  # `--dtype DTYPE`: a string setting left for the reader


def check_tinyllm(args: list[str], allow_missing: bool = False) -> None:
    """Parse ``tinyllm ARGS`` as the CLI would, then validate the settings it names as the
    command would (config keys, types, ranges); raise AssertionError with the parser's sentence."""
    if not args:
        return
    if args[0].startswith("-"):
        names = {o for p in ROOT_CMD.params for o in p.opts + p.secondary_opts} | {"--help"}
        bad = [a for a in args if a.startswith("-") and a not in names]
        assert not bad, f"tinyllm has no option {bad[0]}"
        return
    name, rest = args[0], args[1:]
    sub = ROOT_CMD.commands.get(name)
    assert sub is not None, f"tinyllm has no command {name!r} (it has {', '.join(ROOT_CMD.commands)})"
    parent = ROOT_CMD.make_context("tinyllm", [name], resilient_parsing=True)
    try:
        ctx = sub.make_context(name, list(rest), parent=parent)
    except Exception as e:  # click's UsageError family, whatever copy of click typer vendors
        if type(e).__name__ == "Exit" and getattr(e, "exit_code", 1) == 0:  # --help
            return
        if not (allow_missing and type(e).__name__ == "MissingParameter"):
            msg = e.format_message() if hasattr(e, "format_message") else str(e)
            raise AssertionError(f"tinyllm {name}: {msg}") from None
        ctx = sub.make_context(name, list(rest), parent=parent, resilient_parsing=True)
    shared = {k: v for k, v in ctx.params.items() if k in cli_module.SHARED and k not in own_params(name)
              and not (isinstance(v, str) and PLACEHOLDER.fullmatch(v))}
    if name != "plot":
        try:
            cli_module.Opts(shared).config()
        except Exception as e:
            raise AssertionError(f"tinyllm {name}: {e}") from None


def all_commands() -> list[tuple[Path, Command]]:
    return [(p, c) for p in DOC_FILES for c in shell_commands(p)]


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


# ---- (b) the docs check -----------------------------------------------------------------------

def test_every_documented_tinyllm_command_parses(monkeypatch):
    monkeypatch.chdir(ROOT)  # config paths in the docs are relative to the repository
    seen, failures = set(), []
    for path, c in all_commands():
        if c.kind != "tinyllm":
            continue
        seen.add(c.argv[0] if c.argv else "")
        try:
            check_tinyllm(c.argv)
        except AssertionError as e:
            failures.append(f"{where(path, c.line)}: {c.source}\n    {e}")
    for path in DOC_FILES:
        for line, span in inline_commands(path.read_text()):
            for program, args in commands_in_line(span, {}):
                c = classify(program, args)
                if c and c[0] == "tinyllm":
                    try:
                        check_tinyllm(c[2], allow_missing=True)  # prose may leave out required flags
                    except AssertionError as e:
                        failures.append(f"{where(path, line)}: `{span}`\n    {e}")
    assert not failures, "documented commands that the CLI rejects:\n" + "\n".join(failures)
    assert set(COMMANDS) <= seen, f"no example of {set(COMMANDS) - seen} in a code block"


def test_documented_scripts_make_targets_and_modules_exist():
    scripts: dict[str, set[str]] = {}
    failures = []
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:", makefile, re.M))
    for path, c in all_commands():
        at = f"{where(path, c.line)}: {c.source}"
        if c.kind == "script" or (c.kind == "module" and c.program.startswith("benchmarks")):
            script = c.kind == "script"
            if script and not (ROOT / c.program).is_file():
                failures.append(f"{at}\n    no such script")
                continue
            if c.program not in scripts:
                argv = [c.program] if script else ["-m", c.program]
                r = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True,
                                   timeout=wait_s(120), env={**os.environ, "PYTHONPATH": str(ROOT)})
                if r.returncode != 0:
                    failures.append(f"{at}\n    {c.program} --help failed: {r.stderr[-300:]}")
                    continue
                scripts[c.program] = set(re.findall(r"--[\w-]+", r.stdout))
            bad = [a.split("=")[0] for a in c.argv if a.startswith("--") and a.split("=")[0] not in scripts[c.program]]
            if bad:
                failures.append(f"{at}\n    {c.program} has no option {bad[0]}")
        elif c.kind == "make":
            bad = [t for t in c.argv if not t.startswith("-") and "=" not in t and t not in targets]
            if bad:
                failures.append(f"{at}\n    the Makefile has no target {bad[0]!r}")
        elif c.kind == "module" and c.program.startswith("tinyllm_cli"):
            import importlib.util
            if importlib.util.find_spec(c.program) is None:
                failures.append(f"{at}\n    no module {c.program}")
    assert not failures, "\n".join(failures)
    assert any(p.startswith("scripts/") for p in scripts), "no scripts/*.py command found in the docs"
    assert {"benchmarks.compare", "benchmarks.report"} <= set(scripts), "the docs show no benchmark command"


@pytest.mark.parametrize("args, needle", [
    (["generate", "--prompts", "p.txt", "--no-such-flag"], "--no-such-flag"),
    (["generate", "--max-new-tokens", "4"], "--prompts"),  # a required option left out
    (["bench", "--temperature", "0.5"], "--temperature"),  # a flag bench does not take
    (["serve-batch", "--max-inflight", "many"], "--max-inflight"),  # a value of the wrong type
    (["generate", "--prompts", "p.txt", "--cache", "paged,slot"], "cache.kind"),  # valid flag, bad setting
    (["generate", "--prompts", "p.txt", "--config", "configs/no-such.yaml"], "no-such.yaml"),
    (["plot", "bench.json"], "--output"),
    (["simulator", "--steps", "3"], "no command"),
    (["--no-such-root-flag"], "--no-such-root-flag"),
])
def test_the_parser_check_rejects_what_the_cli_rejects(monkeypatch, args, needle):
    monkeypatch.chdir(ROOT)
    with pytest.raises(AssertionError, match=re.escape(needle)):
        check_tinyllm(args)


def test_the_parser_check_accepts_valid_lines_and_inline_spans_may_omit_required_flags(monkeypatch):
    monkeypatch.chdir(ROOT)
    check_tinyllm(["generate", "--prompts", "p.txt", "--config", "configs/fast.yaml", "--seed", "3", "--n", "2"])
    check_tinyllm(["bench", "--workers", "1,2", "--n", "1,4", "--cache", "paged,slot", "--json", "-"])
    check_tinyllm(["generate", "--help"])
    check_tinyllm(["--version"])
    check_tinyllm(["generate", "--resume"], allow_missing=True)
    with pytest.raises(AssertionError):
        check_tinyllm(["generate", "--resume"])
    with pytest.raises(AssertionError, match="--resumee"):  # prose may leave flags out, not misspell them
        check_tinyllm(["generate", "--resumee"], allow_missing=True)
    with pytest.raises(AssertionError, match="cache.kind"):
        check_tinyllm(["generate", "--cache", "pages"], allow_missing=True)


def test_shell_lines_are_split_like_a_shell():
    md = (
        "```bash\n"
        "# a comment line\n"
        "export N=5\n"
        "cat p.txt | OMP_NUM_THREADS=1 tinyllm generate --prompts - \\\n"
        "    --max-new-tokens $N --seed ${SEED} > out.jsonl 2>&1   # trailing comment\n"
        "producer | tinyllm serve-batch --request-rate 4 >> results.jsonl && echo done\n"
        "tinyllm bench ... --json bench.json; make run\n"
        ".venv/bin/python scripts/kernels_ab.py --repeat 3\n"
        "python -m tinyllm_cli plot b.json -o b.svg\n"
        "```\n"
        "```console\n$ tinyllm generate --prompts x.txt\n{\"id\": 0, \"text\": \"tinyllm --nope\"}\n```\n"
        "```text\ntinyllm generate --not-checked\n```\n"
        "Prose: `tinyllm inspect-blocks --at peak\n--json i.json` and `tinyllm ... | jq`.\n"
    )
    got = [(c.kind, c.argv) for c in shell_commands(md)]
    assert got == [
        ("tinyllm", ["generate", "--prompts", "-", "--max-new-tokens", "5", "--seed", "1"]),
        ("tinyllm", ["serve-batch", "--request-rate", "4"]),
        ("tinyllm", ["bench", "--json", "bench.json"]),
        ("make", ["run"]),
        ("script", ["--repeat", "3"]),
        ("tinyllm", ["plot", "b.json", "-o", "b.svg"]),
        ("tinyllm", ["generate", "--prompts", "x.txt"]),
    ]
    assert [s for _, s in inline_commands(md)] == ["tinyllm inspect-blocks --at peak --json i.json",
                                                   "tinyllm ... | jq"]


def test_every_flag_of_every_command_is_documented():
    text = COMMANDS_MD.read_text()
    missing = []
    for name, cmd in ROOT_CMD.commands.items():
        m = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
        assert m, f"docs/commands.md has no '## {name}' section"
        section, own = m.group(1), own_params(name)
        for p in cmd.params:
            longs = [o for o in p.opts if o.startswith("--")]
            if not longs:
                continue  # an argument
            where_ = section if p.name in own else text
            if not re.search(rf"{re.escape(longs[0])}(?![\w-])", where_):
                missing.append(f"tinyllm {name} {longs[0]}" + (" (in its section)" if p.name in own else ""))
    assert not missing, "flags not in docs/commands.md: " + ", ".join(missing)


def test_python_snippets_compile_and_name_real_settings():
    from tinyllm_cli import SamplingParams
    from tinyllm_cli.config import flat_keys
    llm_ok = set(flat_keys()) | {"config", "progress"}
    failures, count = [], 0
    for path in DOC_FILES:
        for b in code_blocks(path.read_text()):
            if b.lang != "python":
                continue
            count += 1
            tree = ast.parse("\n" * (b.line - 1) + b.body, str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                    valid = {"LLM": llm_ok, "SamplingParams": SamplingParams.field_names()}.get(node.func.id)
                    bad = [k.arg for k in node.keywords if valid is not None and k.arg not in valid]
                    # the notebook shows a misspelt setting on purpose, inside a try
                    if bad and bad != ["max_new_tokenz"]:
                        failures.append(f"{where(path, node.lineno)}: {node.func.id}({bad[0]}=...)")
    assert not failures, "unknown keywords in the docs' Python:\n" + "\n".join(failures)
    assert count >= 10


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_and_anchors_resolve():
    failures = []
    for path in DOC_FILES:
        for line, target in [(prose(path.read_text()).count("\n", 0, m.start()) + 1, m.group(1))
                             for m in re.finditer(r"\]\(([^)\s]+)\)", prose(path.read_text()))]:
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                failures.append(f"{where(path, line)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                heads = {slug(h) for h in re.findall(r"^#+ (.*)$", prose(dest.read_text()), re.M)}
                if anchor not in heads:
                    failures.append(f"{where(path, line)}: {target} (no such heading)")
    assert not failures, "broken links:\n" + "\n".join(failures)


# ---- (d) the README stays a front page --------------------------------------------------------

def test_readme_is_short_and_keeps_its_two_quickstart_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    m = re.search(r"^## Quickstart.*?\n```bash\n(.*?)```", text, re.S | re.M)
    assert m, "README.md has no Quickstart bash block"
    assert m.group(1).splitlines() == [
        "make run    # sets up .venv (CPU torch, the package, the default model) and runs tinyllm generate on prompts/questions.txt",
        "make test   # sets up the same .venv and runs the test suite",
    ]
    make = (ROOT / "Makefile").read_text()
    run = re.search(r"^run: setup\n((?:\t.*\n)+)", make, re.M).group(1)
    test = re.search(r"^test: setup\n((?:\t.*\n)+)", make, re.M).group(1)
    assert "tinyllm generate --prompts prompts/questions.txt" in run and "-m pytest" in test


def test_performance_tables_name_their_cpu_and_date():
    text = (ROOT / "docs" / "performance.md").read_text()
    for m in re.finditer(r"^##(#?) (.*)\n(.*?)(?=^###? |\Z)", text, re.S | re.M):
        _, title, body = m.groups()
        if re.search(r"^\|.*\|$", body, re.M) and title != "On a GPU":
            assert re.search(r"Recorded \d{4}-\d{2}-\d{2}", body), f"performance.md '{title}': no date"
            assert "CPU:" in body and "cores" in body, f"performance.md '{title}': no CPU named"


def rendered(*args: str) -> str:
    """What ``python -m benchmarks.report`` renders from the stored results (it imports no test code)."""
    r = subprocess.run([sys.executable, "-m", "benchmarks.report", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=wait_s(120), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return r.stdout


def between(text: str, begin: str, end: str, name: str) -> str:
    assert text.count(begin) == 1 and text.count(end) == 1, f"{name}: the generated block's markers, once each"
    return text[text.index(begin) + len(begin):text.index(end)].strip("\n") + "\n"


def test_the_comparison_tables_are_the_stored_results():
    """docs/performance.md's tables (the serving comparison's too) and README.md's summary equal
    what the report renders from benchmarks/results: a changed figure, a new result file or a hand edit fails here until
    `python -m benchmarks.report --write docs/performance.md --write README.md` is run."""
    perf = (ROOT / "docs" / "performance.md").read_text()
    begin = "<!-- results: rendered by python -m benchmarks.report from benchmarks/results; do not edit by hand -->"
    tables = between(perf, begin, "<!-- end of results -->", "docs/performance.md")
    assert tables == rendered()
    assert len(re.findall(r"^### ", tables, re.M)) >= 4  # one per CPU class: Zen 4, Ice Lake-SP, Zen 3, AMX
    begin = "<!-- summary: rendered by python -m benchmarks.report --summary; do not edit by hand -->"
    summary = between(README.read_text(), begin, "<!-- end of summary -->", "README.md")
    assert summary == rendered("--summary")
    assert len(summary.splitlines()) <= 15
    begin = ("<!-- serving: rendered by python -m benchmarks.report from benchmarks/results/serving; "
             "do not edit by hand -->")
    assert between(perf, begin, "<!-- end of serving -->", "docs/performance.md") == rendered("--serving")


DIARY = re.compile(r"\b(this|last|previous|next|first|second|third|[a-z]+th) sessions?\b", re.I)


def test_no_session_diary_in_the_docs():
    """The docs say what is true now; history lives in git. (docs/design.md and the kernels README
    are kept by their own owners.)"""
    own = [README, *(p for p in DOCS if p.name != "design.md")]
    bad = [f"{where(p, i)}: {line.strip()[:80]}" for p in own for i, line in enumerate(p.read_text().splitlines(), 1)
           if DIARY.search(line) and "ray session" not in line.lower()]
    assert bad == [], "diary phrasing:\n" + "\n".join(bad)


# ---- (a) the notebook -------------------------------------------------------------------------

def test_python_api_notebook_runs_top_to_bottom(capsys):
    blocks = [b for b in code_blocks(NOTEBOOK.read_text()) if b.lang == "python"]
    source = "\n".join(b.body for b in blocks)
    for feature in ("LLM(", ".generate(", ".stream(", "SamplingParams(", "temperature=", "seed=", "n=3",
                    ".stats", ".reconfigure(", ".close()", "with LLM("):
        assert feature in source, f"the notebook no longer shows {feature}"
    ns: dict = {"__name__": "__docs__"}
    for i, b in enumerate(blocks):
        code = compile("\n" * (b.line - 1) + b.body, str(NOTEBOOK), "exec")  # tracebacks name .md lines
        exec(code, ns)
    out = capsys.readouterr().out
    assert "Paris" in out and "this LLM is closed" in out
    assert ns["llm"]._closed, "the notebook should end with its LLM closed"


# ---- (c) the README's examples, end to end ----------------------------------------------------

def cli(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def readme_example(command: str) -> list[str]:
    found = [c.argv for c in shell_commands(README) if c.kind == "tinyllm" and c.argv[:1] == [command]]
    assert len(found) == 1, f"README.md should show one `tinyllm {command}` example, not {len(found)}"
    return found[0]


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A working directory with the repository's prompts and configs; the batch input's
    completions are capped at 3 tokens so the documented serve-batch line runs quickly."""
    shutil.copytree(ROOT / "prompts", tmp_path / "prompts")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    batch = tmp_path / "prompts" / "batch.jsonl"
    lines = []
    for raw in batch.read_text().splitlines():
        rec = json.loads(raw)
        for key in ("max_tokens", "max_completion_tokens"):
            if key in rec["body"]:
                rec["body"][key] = min(rec["body"][key], 3)
        if not {"max_tokens", "max_completion_tokens"} & set(rec["body"]):
            rec["body"]["max_tokens"] = 3
        lines.append(json.dumps(rec))
    batch.write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_readme_generate_then_plot_its_stats(capsys, scratch):
    code, out, err = cli(capsys, *readme_example("generate"), "--max-new-tokens", "2", "-q")
    assert code == 0, err
    rows = [json.loads(x) for x in (scratch / "out.jsonl").read_text().splitlines()]
    n_prompts = sum(1 for x in (scratch / "prompts" / "questions.txt").read_text().splitlines() if x.strip())
    assert [r["id"] for r in rows] == list(range(n_prompts))
    assert all(isinstance(r["seed"], int) and r["num_output_tokens"] <= 2 for r in rows)
    assert json.loads((scratch / "stats.json").read_text())["num_requests"] == n_prompts
    args = readme_example("plot")
    code, out, err = cli(capsys, *args)
    assert code == 0, err
    assert (scratch / args[args.index("-o") + 1]).read_text().lstrip().startswith("<?xml")


def test_readme_serve_batch(capsys, scratch):
    code, out, err = cli(capsys, *readme_example("serve-batch"), "-q")
    assert code == 0, err
    lines = [json.loads(x) for x in (scratch / "results.jsonl").read_text().splitlines()]
    want = {json.loads(x)["custom_id"] for x in (scratch / "prompts" / "batch.jsonl").read_text().splitlines()}
    assert {x["custom_id"] for x in lines} == want
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in lines)


def test_readme_bench_inspect_blocks_and_plot_on_a_tiny_model(capsys, scratch, llama_dir):
    code, out, err = cli(capsys, *readme_example("bench"), "--model", llama_dir, "--num-prompts", "4",
                         "--input-len", "16", "--output-len", "4", "--max-model-len", "64", "--kv-memory", "256KiB",
                         "--json", "bench.json", "-q")
    assert code == 0, err
    rows = json.loads((scratch / "bench.json").read_text())
    assert [(r["cache_kind"], r["block_size"]) for r in rows][:3] == [("paged", 8), ("paged", 16), ("paged", 32)]
    assert rows[-1]["cache_kind"] == "slot" and all(r["output_tokens"] == 16 for r in rows)
    code, out, err = cli(capsys, *readme_example("inspect-blocks"), "--model", llama_dir, "--output-len", "4",
                         "--json", "inspect.json", "-q")
    assert code == 0, err
    report = json.loads((scratch / "inspect.json").read_text())
    assert report["snapshot"]["num_blocks"] == 64 and report["at"] == "peak"
    for saved in ("bench.json", "inspect.json"):  # commands.md's plot examples, on these files
        code, out, err = cli(capsys, "plot", saved, "-o", saved.replace(".json", ".svg"))
        assert code == 0 and out == "", err


def test_readme_python_block_runs(capsys):
    [block] = [b for b in code_blocks(README.read_text()) if b.lang == "python"]
    exec(compile("\n" * (block.line - 1) + block.body, str(README), "exec"), {"__name__": "__docs__"})
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) >= 3 and float(printed[-1]) > 0  # two answers (a text may hold newlines), then tok/s
