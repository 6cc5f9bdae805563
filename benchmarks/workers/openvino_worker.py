"""OpenVINO GenAI side of ``python -m benchmarks.compare``; runs under the OpenVINO venv's Python, never imports tinyllm.

``serve`` builds one ``openvino_genai.ContinuousBatchingPipeline`` on a model directory exported
by ``optimum-cli export openvino`` and answers requests read as JSON lines on stdin, so every
timed run finds the pipeline warm (compiled, KV cache allocated). Each request is
``{"prompts": [[ids...], ...], "max_tokens": N}``; each answer is one stdout line
``@@RESULT {"elapsed_s": ..., "token_ids": [[...], ...]}``; every other line is log.

Prompts go in as token ids (one ``ov.Tensor`` of shape [1, len] each, the pipeline's
``generate(input_ids, configs)`` overload): the tokenizer the export wrote is never used, so
every engine sees the same ids. Greedy (``do_sample=False``), ``ignore_eos``, exactly
``max_tokens`` new tokens (min = max).

Precision is never left to the plugin: on a CPU with AVX512-BF16 the CPU plugin silently computes
in bf16 and keeps K/V as u8 unless told otherwise, so ``INFERENCE_PRECISION_HINT`` and
``KV_CACHE_PRECISION`` are always set, and the threads are fixed (``INFERENCE_NUM_THREADS``, one
stream: the pipeline runs one infer request, which a second stream would only split). The KV
pool is ``SchedulerConfig.cache_size`` GB, the same memory every other engine gets.

``--probe-isa`` (``compare --isa``): the ready line also carries ``primitive_types``, what the CPU
plugin runs for each node (see primitive_types), so a cap on its instruction set is verified.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

MARKER = "@@RESULT "


def properties(args) -> dict:
    """The CPU plugin settings, all explicit (see the module docstring for why)."""
    return {"INFERENCE_PRECISION_HINT": args.precision, "KV_CACHE_PRECISION": args.kv_precision,
            "INFERENCE_NUM_THREADS": args.threads, "NUM_STREAMS": 1}


def build_pipeline(args):
    import openvino_genai as ov_genai
    sc = ov_genai.SchedulerConfig()
    sc.cache_size = args.kv_gb  # GB of K/V blocks, allocated up front
    sc.max_num_seqs = args.max_num_seqs
    sc.max_num_batched_tokens = args.max_num_batched_tokens
    sc.enable_prefix_caching = False  # no run may reuse another's prompts
    return ov_genai.ContinuousBatchingPipeline(args.model, sc, "CPU", properties(args))


def generation_config(max_tokens: int):
    import openvino_genai as ov_genai
    g = ov_genai.GenerationConfig()
    g.max_new_tokens = g.min_new_tokens = max_tokens
    g.ignore_eos = True
    g.do_sample = False
    return g


def generate(pipe, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Wall time of the ``generate`` call alone (the tensors are built before the timer starts)."""
    import numpy as np
    import openvino as ov
    ids = [ov.Tensor(np.asarray([p], dtype=np.int64)) for p in prompts]
    configs = [generation_config(max_tokens)] * len(prompts)
    t0 = time.perf_counter()
    outs = pipe.generate(ids, configs)
    elapsed = time.perf_counter() - t0
    return elapsed, [list(o.m_generation_ids[0]) for o in outs]


def primitive_types(args) -> dict:
    """What the CPU plugin runs for each node, ``{"<layerType> <primitiveType>": count}``, read from
    the runtime graph (``get_runtime_model``) of the export's own stateful model compiled with the
    pipeline's properties after one 16-token inference (a dynamic node's primitive is chosen when
    it first runs; the pipeline's own compiled model is not reachable from its API). Its matmuls,
    norms and elementwise nodes are the pipeline's; its attention is SDPA where the pipeline's is
    PagedAttention."""
    import collections

    import numpy as np
    import openvino as ov
    core = ov.Core()
    compiled = core.compile_model(core.read_model(f"{args.model}/openvino_model.xml"), "CPU", properties(args))
    n = 16
    feed = {"input_ids": np.arange(5, 5 + n, dtype=np.int64)[None], "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)}
    req = compiled.create_infer_request()
    req.infer({k: v for k, v in feed.items() if k in {i.get_any_name() for i in compiled.inputs}})
    counts = collections.Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        layer = info["layerType"].astype(str) if "layerType" in info else "?"
        if layer in ("Const", "Input", "Output", "Reshape", "MemoryInput", "MemoryOutput"):
            continue  # no computation
        counts[f"{layer} {info['primitiveType'].astype(str) if 'primitiveType' in info else '?'}"] += 1
    return dict(sorted(counts.items()))


def serve(args) -> None:
    probe = {"primitive_types": primitive_types(args)} if args.probe_isa else {}  # freed before the pipeline
    pipe = build_pipeline(args)
    generate(pipe, [[5, 6, 7, 8]] * 2, 4)  # first-call costs stay out of every timed run
    info = {"ready": True, "properties": properties(args), "cache_size_gb": args.kv_gb} | probe
    print(MARKER + json.dumps(info), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        elapsed, ids = generate(pipe, req["prompts"], req["max_tokens"])
        print(MARKER + json.dumps({"elapsed_s": elapsed, "token_ids": ids}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("serve",))
    p.add_argument("--model", required=True, help="a directory written by optimum-cli export openvino")
    p.add_argument("--precision", required=True, choices=("f32", "bf16"), help="INFERENCE_PRECISION_HINT")
    p.add_argument("--kv-precision", required=True, choices=("f32", "bf16", "f16", "u8"), help="KV_CACHE_PRECISION")
    p.add_argument("--kv-gb", type=int, required=True, help="SchedulerConfig.cache_size")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--probe-isa", action="store_true",
                   help="report the CPU plugin's primitive type per node in the ready line (primitive_types)")
    serve(p.parse_args())


if __name__ == "__main__":
    main()
