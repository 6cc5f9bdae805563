"""llama.cpp's greedy tokens for ``python -m benchmarks.compare``'s agreement column; never imports tinyllm.

``llama-batched-bench`` (the timed llama.cpp row) draws its own token ids and prints no tokens,
so the agreement of llama.cpp with transformers is measured here instead, untimed: the Python
layer of the llama-cpp-python sdist the tools were built from (put on ``PYTHONPATH`` by the
caller), over the ``libllama`` of that same build (``LLAMA_CPP_LIB_PATH``). Each prompt's ids are
evaluated as given (no tokenizer, no BOS added), then exactly ``max_tokens`` tokens are taken
greedily (temperature 0: llama.cpp's greedy sampler), EOS ignored, one prompt at a time, 2 threads,
K/V in f16 (llama.cpp's default, as in the batched bench). ``--no-repack`` turns llama.cpp's
weight repacking off, as the caller does for its tools after an AMX crash.

Reads a JSON list of token-id lists from ``--prompts``; writes ``{"token_ids": [[...], ...]}``
to ``--output``.
"""

from __future__ import annotations

import argparse
import json


def greedy(llm, prompt: list[int], max_tokens: int) -> list[int]:
    out = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
        out.append(int(tok))
        if len(out) == max_tokens:  # generate() never stops by itself: EOS is ignored here
            break
    return out


def no_repack() -> None:
    """llama-cpp-python's ``Llama`` has no repack switch; its model parameters start from
    ``llama_model_default_params()``, so that function is wrapped to turn ``use_extra_bufts`` off
    (as ``--no-repack`` does for llama.cpp's own tools)."""
    import llama_cpp.llama_cpp as lib
    defaults = lib.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p
    lib.llama_model_default_params = params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-repack", action="store_true", help="keep weights out of llama.cpp's extra buffer types")
    args = p.parse_args()
    from llama_cpp import Llama
    if args.no_repack:
        no_repack()
    with open(args.prompts) as fh:
        prompts = json.load(fh)
    n_ctx = max(map(len, prompts)) + args.max_tokens + 16
    llm = Llama(model_path=args.gguf, n_ctx=n_ctx, n_batch=512, n_threads=args.threads,
                n_threads_batch=args.threads, seed=0, verbose=False)
    ids = [greedy(llm, prompt, args.max_tokens) for prompt in prompts]
    with open(args.output, "w") as fh:
        json.dump({"token_ids": ids}, fh)


if __name__ == "__main__":
    main()
