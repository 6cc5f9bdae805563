"""Output bits of a checkout: the token ids the default model generates on a fixed prompt set,
along every path a refactor could disturb, written as JSON; ``--compare`` says which paths of
two such files match token for token.

    PYTHONPATH=../wt-before python scripts/bits_check.py --json before.json   # an older checkout
    PYTHONPATH=$PWD         python scripts/bits_check.py --json after.json
    python scripts/bits_check.py --compare before.json after.json

Only the public API is used (``LLM``, ``generate``, ``reconfigure``, ``SamplingParams``), so the
same script runs against any checkout that has it: the tree it measures is whichever
``tinyllm_cli`` the import finds first (``PYTHONPATH``), and the file records which one.

Paths (each run on a chat group and a plain-text group of prompts, one model load):
paged and slot caches, greedy and seeded sampled (temperature 0.8, top_p 0.9, a fixed seed per
prompt, and one run seed with per-request derivation); ngram speculative decoding (the suite's
front-door setting, 3 draft tokens) on both caches, greedy and sampled; structured output
against a JSON schema, greedy and sampled; n=2 with a seed.

Invariants:
- A path's record is a list, one entry per prompt in order, of each completion's token ids and
  finish reason; nothing else in the file is compared.
- Every setting that decides the bits is fixed here or recorded in ``meta`` (dtype, torch,
  kernels, CPU flags), so a mismatch between two files is a change in the code, or in something
  ``meta`` shows differs.
- ``--compare`` prints results on stdout and exits 1 when any path differs or is missing from
  one file; a file that cannot be read is one sentence on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

CHAT_PROMPTS = [
    "Name a colour.",
    "What is the capital of France? Answer in one word.",
    "Write a haiku about autumn leaves falling in a quiet park.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than ten, separated by commas.",
    ("The city council met on Tuesday to discuss the new bicycle lanes on Main Street. After two hours "
     "of debate, the council voted 5 to 2 to fund the project, which will cost 1.2 million dollars and "
     "should be finished by next spring. Summarize this in one sentence."),
    "Translate 'good morning' into Spanish.",
]
PLAIN_PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "1, 2, 3, 4, 5,",
    "The three laws of thermodynamics are",
    ("Photosynthesis is the process by which green plants and some other organisms use sunlight to "
     "synthesize foods from carbon dioxide and water. In plants, it generally involves"),
]
JSON_PROMPTS = [
    "Give me a JSON object describing a person named Ada who is 36 years old.",
    "Return a JSON object for a book: its title and the year it was published.",
    "Describe a cat as JSON with a name and an age.",
]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}

NEW_TOKENS = 32
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
SEED_BASE = 1000  # prompt i samples with seed SEED_BASE + i
RUN_SEED = 7  # the run seed of the derived-seed path


def per_prompt(group: list[str], **fields) -> list:
    """One SamplingParams per prompt; a sampled one gets the fixed seed of its position."""
    from tinyllm_cli import SamplingParams
    seeded = fields.get("temperature", 0) > 0 and "seed" not in fields
    return [SamplingParams(max_new_tokens=NEW_TOKENS, **fields, **({"seed": SEED_BASE + i} if seeded else {}))
            for i in range(len(group))]


def record(outs) -> list[dict]:
    return [{"completions": [{"token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
                             for c in o.completions]} for o in outs]


def run_groups(llm, groups: dict[str, tuple[list[str], bool]], **fields) -> list[dict]:
    """Every group's prompts under the same sampling fields, in one list (chat group first)."""
    rows = []
    for prompts, chat in groups.values():
        rows += record(llm.generate(prompts, per_prompt(prompts, **fields), chat=chat, use_tqdm=False))
    return rows


def collect(llm, log) -> dict[str, list[dict]]:
    """Every path's records, reconfiguring one loaded model between them."""
    text = {"chat": (CHAT_PROMPTS, True), "plain": (PLAIN_PROMPTS, False)}
    paths: dict[str, list[dict]] = {}
    for cache in ("paged", "slot"):
        llm.reconfigure(cache=cache, speculative="none")
        log(f"{cache}: greedy, sampled, n=2")
        paths[f"{cache}/greedy"] = run_groups(llm, text)
        paths[f"{cache}/sampled"] = run_groups(llm, text, **SAMPLED)
        paths[f"{cache}/n2_sampled"] = run_groups(llm, text, n=2, **SAMPLED)
        llm.reconfigure(cache=cache, speculative="ngram", num_speculative_tokens=3)
        log(f"{cache}: ngram speculative, greedy and sampled")
        paths[f"{cache}/spec_ngram_greedy"] = run_groups(llm, text)
        paths[f"{cache}/spec_ngram_sampled"] = run_groups(llm, text, **SAMPLED)
    llm.reconfigure(cache="paged", speculative="none", seed=RUN_SEED)
    log("paged: sampled with seeds derived from the run seed")
    paths["paged/sampled_run_seed"] = run_groups(llm, text, **SAMPLED, seed=None)
    json_group = {"chat": (JSON_PROMPTS, True)}
    log("paged: structured output (JSON schema)")
    paths["paged/json_schema_greedy"] = run_groups(llm, json_group, json_schema=SCHEMA)
    paths["paged/json_schema_sampled"] = run_groups(llm, json_group, json_schema=SCHEMA, **SAMPLED)
    return paths


def meta(llm) -> dict:
    import torch
    import tinyllm_cli
    tree = Path(tinyllm_cli.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    from tinyllm_cli import kernels
    return {"tree": str(tree), "commit": commit, "dirty": bool(dirty), "dtype": str(llm.runtime.dtype),
            "torch": torch.__version__, "kernels": kernels.load(), "python": platform.python_version(),
            "cpu": _cpu_model(), "new_tokens": NEW_TOKENS, "sampled": SAMPLED, "seed_base": SEED_BASE,
            "run_seed": RUN_SEED}


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def measure(out: Path, dtype: str) -> None:
    from tinyllm_cli import LLM

    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"bits_check: {time.perf_counter() - start:6.1f} s  {msg}", file=sys.stderr, flush=True)

    # A short max_model_len keeps the slot cache's reservations (and its runs) small; no prompt
    # here comes near it, and it decides nothing else.
    with LLM("default", progress=False, dtype=dtype, num_blocks=256, max_num_seqs=16, max_model_len=512) as llm:
        about = meta(llm)  # before the run: the commit is the one measured, not one made meanwhile
        paths = collect(llm, log)
        data = {"meta": about, "paths": paths}
    out.write_text(json.dumps(data, indent=1) + "\n")
    log(f"{len(paths)} paths written to {out}")


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data["paths"], data.get("meta", {})
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"bits_check: cannot read {path} as a bits_check file ({type(e).__name__}: {e})", file=sys.stderr)
        sys.exit(2)


def first_difference(a: list[dict], b: list[dict]) -> str:
    """Where two records of one path first part: prompt, completion and token index."""
    for i, (ra, rb) in enumerate(zip(a, b)):
        for j, (ca, cb) in enumerate(zip(ra["completions"], rb["completions"])):
            ta, tb = ca["token_ids"], cb["token_ids"]
            if ta != tb:
                k = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
                return f"prompt {i} completion {j} token {k}"
        if len(ra["completions"]) != len(rb["completions"]):
            return f"prompt {i}: {len(ra['completions'])} vs {len(rb['completions'])} completions"
    return f"{len(a)} vs {len(b)} prompts"


def compare(a_path: Path, b_path: Path) -> int:
    (a, meta_a), (b, meta_b) = load(a_path), load(b_path)
    for key in ("commit", "dtype", "torch", "cpu"):
        if meta_a.get(key) != meta_b.get(key):
            print(f"# {key}: {meta_a.get(key)} vs {meta_b.get(key)}", file=sys.stderr)
    print("| path | sequences | tokens | result |")
    print("|---|---|---|---|")
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            bad += 1
            print(f"| {name} | - | - | only in {a_path if name in a else b_path} |")
            continue
        seqs = [c["token_ids"] for r in a[name] for c in r["completions"]]
        same = a[name] == b[name]
        bad += not same
        print(f"| {name} | {len(seqs)} | {sum(map(len, seqs))} | "
              f"{'identical' if same else 'DIFFERS at ' + first_difference(a[name], b[name])} |")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write this checkout's token ids here")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), help="which paths of two files match")
    ap.add_argument("--dtype", default="auto", help="the model's dtype (default: auto, as the CLI's)")
    args = ap.parse_args()
    if bool(args.json) == bool(args.compare):
        ap.error("give exactly one of --json OUT and --compare A B")
    if args.compare:
        return compare(*args.compare)
    measure(args.json, args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
