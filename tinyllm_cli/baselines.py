"""Reference points for ``bench``: transformers' own ``generate`` on the identical workload, and
the machine's GEMM rate on the model's own matrix shapes (the roofline), on the engine's own
matmul path and, for comparison, on plain ``F.linear``.

Invariants:
- The baseline sees the same prompt ids, greedy, with exactly ``output_len`` new tokens each
  (``min_new_tokens`` = ``max_new_tokens``), one left-padded batch, in the same process, after
  tinyllm's runs, loaded independently through transformers (GGUF dequantized by transformers).
- FLOPs per token count every matmul of the model as if each token went through the output
  projection (2 x multiply-adds); that is the usual tokens/s <-> FLOP/s conversion.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import TinyLLMError
from .model import hub
from .model.checkpoint import default_model_path
from .model.gemm import PackedLinear


def _hf_model(spec: str | None, dtype: torch.dtype, device: torch.device):
    try:
        import transformers
    except ImportError:
        raise TinyLLMError("--baseline hf needs transformers: pip install 'tinyllm[test]'")
    path = default_model_path() if spec in (None, "", "default") else Path(spec)
    if not path.exists() and hub.is_hub_id(str(spec)):  # the snapshot tinyllm itself loaded
        path = hub.resolve(str(spec), progress=False)
    kw = dict(dtype=dtype)
    if path.suffix.lower() == ".gguf":
        kw["gguf_file"] = path.name
        path = path.parent
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kw)
    return model.to(device).eval()


def hf_generate_baseline(spec: str | None, workload: list[list[int]], output_len: int, dtype: torch.dtype,
                         device: torch.device, pad_id: int, repeat: int = 1) -> dict:
    """transformers ``generate`` on one left-padded batch, ``repeat`` times; returns the median
    timing, every run's time and the new tokens."""
    model = _hf_model(spec, dtype, device)
    longest = max(map(len, workload))
    ids = torch.full((len(workload), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(workload):
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    gen = dict(do_sample=False, pad_token_id=pad_id, num_beams=1)
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=2, min_new_tokens=2, **gen)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                 **gen)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    elapsed = sorted(times)[(repeat - 1) // 2]
    new = out[:, longest:].tolist()
    total = sum(map(len, workload)) + len(workload) * output_len
    return {"engine": "transformers generate (one padded batch)", "elapsed_s": round(elapsed, 4),
            "elapsed_s_runs": [round(t, 4) for t in times],
            "total_tokens_per_s": round(total / elapsed, 2),
            "output_tokens_per_s": round(len(workload) * output_len / elapsed, 2), "token_ids": new}


def layer_shapes(cfg) -> list[tuple[int, int, int]]:
    """(in, out, count per token) of every matmul the model runs for one token."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = [(h, d * (cfg.num_heads + 2 * cfg.num_kv_heads)), (cfg.num_heads * d, h),
                 (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)]
    return [(i, o, cfg.num_layers) for i, o in per_layer] + [(h, cfg.vocab_size, 1)]


def measure_roofline(cfg, dtype: torch.dtype, device: torch.device, gemm: str = "torch", tokens: int = 256,
                     reps: int = 10) -> dict:
    """GEMM FLOP/s of ``tokens`` rows through each of the model's weight shapes, on the matmul
    path ``gemm`` ('torch' = F.linear, 'onednn' = the packed linears the engine uses)."""
    shapes = layer_shapes(cfg)
    ws = [torch.randn(o, i, dtype=dtype, device=device) for i, o, _ in shapes]
    xs = [torch.randn(tokens, i, dtype=dtype, device=device) for i, _, _ in shapes]
    fns = [PackedLinear(w, None) if gemm == "onednn" else partial(F.linear, weight=w) for w in ws]

    def seconds(fn, x) -> float:
        fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    # Each shape is weighted by how often one token meets it (30 layers vs one output projection),
    # so the rate is that of the model's own mix of matmuls.
    elapsed = sum(n * seconds(fn, x) for fn, x, (_, _, n) in zip(fns, xs, shapes))
    flops = sum(2 * tokens * i * o * n for i, o, n in shapes)
    rate = flops / elapsed
    per_token = sum(2 * i * o * n for i, o, n in shapes)
    return {"gemm": gemm, "gemm_gflops": round(rate / 1e9, 1), "flops_per_token": per_token,
            "roofline_tokens_per_s": round(rate / per_token, 1), "gemm_rows": tokens}
