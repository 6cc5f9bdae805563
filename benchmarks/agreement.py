"""Greedy agreement: how far an engine's tokens follow the reference's, prompt by prompt."""

from __future__ import annotations

from .common import INT4

# What each row is scored against: transformers in the row's own precision, and in f32 for the
# 4-bit rows (so their score is the accuracy cost of 4 bits plus the engine's own rounding).
REFERENCE_DTYPE = {"float32": "float32", "bfloat16": "bfloat16", INT4: "float32"}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """How far an engine's greedy tokens follow the reference's, prompt by prompt: ``exact`` =
    sequences equal in full; ``prefix_frac`` = tokens before the first difference over all
    reference tokens (after a difference the two continue from different text, so later equal
    tokens are not counted); ``same_pos_frac`` = tokens equal at the same position, for reference."""
    if len(ref) != len(got):
        raise ValueError(f"{len(got)} outputs for {len(ref)} prompts")
    total = sum(map(len, ref)) or 1
    prefix = sum(common_prefix(r, g) for r, g in zip(ref, got))
    same = sum(x == y for r, g in zip(ref, got) for x, y in zip(r, g))
    exact = sum(list(r) == list(g) for r, g in zip(ref, got))
    return {"exact": exact, "n": len(ref), "prefix_tokens": prefix, "tokens": total,
            "prefix_frac": round(prefix / total, 4), "same_pos_frac": round(same / total, 4)}


def agreement_text(ag: dict | None) -> str:
    """'15/16 · 97%': sequences equal in full, and the prefix fraction."""
    if not ag:
        return "-"
    return f"{ag['exact']}/{ag['n']} · {ag['prefix_frac']:.0%}"
