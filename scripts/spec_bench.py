"""Speculative decoding, measured: one prompt at a time, with and without, on input-grounded work.

For each workload (summarize, rewrite, extract, code edit: the prompts are below, wrapped in the
chat template as ``generate`` does) and each method, runs the prompt greedily without and with
speculation, interleaved A/B, ``--runs`` times each, and prints a markdown table on stdout:
workload, method, acceptance rate, tokens per verification, engine steps without and with,
decode tok/s without and with (medians), speed-up, and whether every run's output tokens were
the same. Decode tok/s is 1 / TPOT (time after the first token over the tokens after it), so
prefill is left out. The step counts do not depend on the machine's load: on a busy machine
their ratio is the steadier figure (a verify step costs about one decode step when the forward
is bound by reading the weights).

    python scripts/spec_bench.py                           # default model, float32, ngram
    python scripts/spec_bench.py --config configs/fast.yaml  # the 4-bit fast settings
    python scripts/spec_bench.py --target BIG.gguf --methods ngram,draft   # draft: 'default' drafts
    python scripts/spec_bench.py --methods draft --draft-quant gguf   # the 135M's own 4-bit blocks draft

The draft-model row needs a target bigger than the draft with the same tokenizer (``--target``),
or a draft kept cheaper than the target (``--draft-quant gguf``: the draft GGUF's 4-bit blocks,
under the float32 target); without either it is skipped with a note on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from tinyllm_cli import LLM, SamplingParams

TEXT = ("The city council met on Tuesday evening to discuss the proposed bicycle lanes on Main Street. "
        "After two hours of public comment, the council voted 5 to 2 to fund the project, which will cost "
        "1.2 million dollars and is expected to be finished by next spring. Supporters said the lanes would "
        "make the street safer for children riding to school. Residents who opposed the plan said it would "
        "remove 40 parking spaces and hurt the small shops along the street. The mayor promised that the "
        "city would study parking in the area again after the lanes open.")

CODE = '''def average(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def report(values):
    print("count:", len(values))
    print("average:", average(values))
'''

WORKLOADS = {
    "summarize": f"Summarize the following text in three sentences.\n\n{TEXT}",
    "rewrite": f"Rewrite the following text in simpler words, keeping every fact.\n\n{TEXT}",
    "extract": ("Extract these fields from the text as JSON: meeting_day, vote_for, vote_against, cost, "
                f"finish_date, parking_spaces_removed.\n\n{TEXT}"),
    "code edit": ("Edit this Python code so that average returns 0 for an empty list. Reply with the whole "
                  f"edited code.\n\n```python\n{CODE}```"),
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="Target model for the ngram rows (default: the 135M).")
    ap.add_argument("--config", default=None, help="A config file, e.g. configs/fast.yaml.")
    ap.add_argument("--dtype", default=None, help="float32 (the default without --config), bfloat16, ...")
    ap.add_argument("--methods", default="ngram", help="Comma list: ngram, draft.")
    ap.add_argument("--target", default=None, help="draft rows: a target bigger than the draft, same tokenizer.")
    ap.add_argument("--draft-model", default="default", help="draft rows: the drafting model (default: the 135M).")
    ap.add_argument("--draft-quant", default=None, help="draft rows: how the draft keeps its weights (gguf: 4-bit).")
    ap.add_argument("--quant-activations", default=None, help="bfloat16, int8 or auto (the 4-bit matmuls' input).")
    ap.add_argument("--num-tokens", type=int, default=4, help="Draft tokens per step.")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="Runs per side (the table shows medians).")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="Comma list of: " + ", ".join(WORKLOADS))
    return ap.parse_args(argv)


def measure(llm: LLM, prompt: str, params: SamplingParams, spec: dict, runs: int) -> dict:
    """Interleaved A/B: plain then speculative, ``runs`` times; medians and the outputs seen."""
    tps = {"plain": [], "spec": []}
    steps = {}
    outs, acc, per_verify = set(), [], []
    for _ in range(runs):
        for side, settings in (("plain", {"speculative": "none"}), ("spec", spec)):
            llm.reconfigure(**settings)  # a fresh pool each run: no prefix-cache hits carried over
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            tps[side].append(1 / out.tpot_s if out.tpot_s else 0.0)
            outs.add(tuple(out.token_ids))
            steps[side] = llm.stats.steps
            if side == "spec":
                acc.append(llm.stats.spec_acceptance_rate)
                per_verify.append(llm.stats.spec_tokens_per_verify)
    plain, with_ = statistics.median(tps["plain"]), statistics.median(tps["spec"])
    return {"acceptance": statistics.median(acc), "per_verify": statistics.median(per_verify),
            "steps": (steps["plain"], steps["spec"]), "plain": plain, "spec": with_,
            "speedup": with_ / plain if plain else 0.0, "same": len(outs) == 1}


def main(argv=None) -> None:
    a = parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    names = [w.strip() for w in a.workloads.split(",") if w.strip()]
    bad = [m for m in methods if m not in ("ngram", "draft")] + [w for w in names if w not in WORKLOADS]
    if bad:
        sys.exit(f"error: unknown method or workload {bad[0]!r}")
    if a.runs < 1 or a.max_new_tokens < 2:
        sys.exit("error: --runs must be >= 1 and --max-new-tokens >= 2")
    params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.0)
    dtype = a.dtype or (None if a.config else "float32")
    common = dict(max_num_seqs=4, num_speculative_tokens=a.num_tokens) | ({"dtype": dtype} if dtype else {})
    common |= {"quant_activations": a.quant_activations} if a.quant_activations else {}
    rows = []
    for method in methods:
        if method == "draft" and a.target is None and a.draft_quant is None:
            print("note: the draft row needs --target (a model bigger than the draft with the same tokenizer) or "
                  "--draft-quant gguf (a 4-bit draft); skipped", file=sys.stderr)
            continue
        model = (a.target or a.model) if method == "draft" else a.model
        spec = {"speculative": method}
        if method == "draft":
            spec |= {"draft_model": a.draft_model} | ({"draft_quant": a.draft_quant} if a.draft_quant else {})
        with LLM(model, config=a.config, progress=False, **common) as llm:
            warm = SamplingParams(max_new_tokens=8, temperature=0.0)
            measure(llm, WORKLOADS[names[0]], warm, spec, 1)  # first-call costs (kernels, shapes) out of the way
            for name in names:
                print(f"{method} / {name} ...", file=sys.stderr, flush=True)
                rows.append((name, method, measure(llm, WORKLOADS[name], params, spec, a.runs)))
            what = llm.runtime.describe()
    if not rows:
        return
    print(f"One prompt at a time, greedy, {a.max_new_tokens} new tokens max, k = {a.num_tokens}, "
          f"median of {a.runs} interleaved runs; {what}.\n")
    print("| workload | method | acceptance | tok / verify | steps without / with | decode tok/s without | with "
          "| speed-up | same output |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, method, r in rows:
        print(f"| {name} | {method} | {r['acceptance']:.0%} | {r['per_verify']:.2f} | {r['steps'][0]} / {r['steps'][1]} "
              f"| {r['plain']:.1f} | {r['spec']:.1f} | {r['speedup']:.2f}x | {'yes' if r['same'] else 'NO'} |")


if __name__ == "__main__":
    main()
