"""The workloads: W1, W2 and long (batched, total tok/s), e2e, and the single stream; their prompt
ids are the seeded ones ``tinyllm bench`` draws, or windows of natural text for the ``real`` shape.

Invariant: the same seed gives every engine the same prompt ids in every round.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from .common import REPO, Skip

SINGLE_PROMPT = "Explain what a hash table is in two sentences."


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int  # prompt lengths uniform in input_len*(1-r)..input_len*(1+r), as `tinyllm bench`
    range_ratio: float
    output_len: int


FULL = {"W1": Workload(16, 96, 0.333, 32), "W2": Workload(32, 48, 0.333, 64), "long": Workload(1, 2000, 0.0, 16),
        "e2e": Workload(64, 48, 0.333, 64)}
QUICK = {"W1": Workload(4, 12, 0.333, 4), "W2": Workload(6, 6, 0.333, 8), "long": Workload(1, 40, 0.0, 4),
         "e2e": Workload(8, 6, 0.333, 8)}
SINGLE_NEW = {"full": 128, "quick": 8}


def longest_sequence(workloads: dict, benches) -> int:
    """Positions the longest sequence of these workloads reaches (its prompt's longest draw plus
    its new tokens): the context an engine must accept for them."""
    return max((int(wl.input_len * (1 + wl.range_ratio)) + 1 + wl.output_len
                for b, wl in workloads.items() if b in benches), default=0)


def make_prompts(hf_dir: Path, wl: Workload, seed: int) -> list[list[int]]:
    """The same seeded prompts `tinyllm bench` draws (ids above the special tokens)."""
    from tinyllm_cli.workload import random_prompts
    cfg = json.loads((hf_dir / "config.json").read_text())
    eos = cfg.get("eos_token_id", 0)
    mcfg = SimpleNamespace(vocab_size=cfg["vocab_size"], eos_token_ids=eos if isinstance(eos, list) else [eos],
                           bos_token_id=cfg.get("bos_token_id"))
    return random_prompts(mcfg, wl.num_prompts, wl.input_len, wl.range_ratio, seed)


# Natural text for the ``real`` shape: random ids give even a trained model flat, near-tied logits,
# which would make its accuracy rows measure rounding luck. These are the repository's own prompt
# files (each distinct string once), tokenized by the default model's tokenizer.
TEXT_SOURCES = ("prompts/questions.txt", "prompts/mixed.jsonl", "prompts/batch.jsonl", "prompts/support-chat.jsonl")


def prompt_texts(paths) -> list[str]:
    """Every distinct prompt string in the files, in order: lines of a .txt file, the ``prompt``
    and each message's ``content`` of a .jsonl file."""
    out: dict[str, None] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            if not str(path).endswith(".jsonl"):
                out[line.strip()] = None
                continue
            rec = json.loads(line)
            for text in [rec.get("prompt")] + [m.get("content") for m in rec.get("messages", [])]:
                if text:
                    out[text] = None
    return list(out)


def text_windows(stream: list[int], lengths: list[int], seed: int) -> list[list[int]]:
    """One window of the token stream per length, at seeded offsets (the same every run)."""
    import random
    g = random.Random(seed)
    if max(lengths) > len(stream):
        raise Skip(f"the prompt texts hold {len(stream)} tokens, fewer than a {max(lengths)}-token prompt")
    return [stream[o:o + n] for n in lengths for o in [g.randrange(len(stream) - n + 1)]]


def real_prompts(hf_dir: Path, wl: Workload, seed: int) -> list[list[int]]:
    """The ``real`` shape's prompts: the lengths `tinyllm bench` would draw, filled with windows of
    natural text (TEXT_SOURCES) instead of random ids; same token counts as the other shapes."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    stream = tok("\n".join(prompt_texts(REPO / p for p in TEXT_SOURCES)), add_special_tokens=False)["input_ids"]
    lengths = [len(p) for p in make_prompts(hf_dir, wl, seed)]
    return text_windows(stream, lengths, seed)


def shape_prompts(shape: str, hf_dir: Path, wl: Workload, seed: int) -> list[list[int]]:
    return real_prompts(hf_dir, wl, seed) if shape == "real" else make_prompts(hf_dir, wl, seed)


def total_tokens(prompts: list[list[int]], output_len: int) -> int:
    return sum(map(len, prompts)) + len(prompts) * output_len
