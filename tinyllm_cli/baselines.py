"""Reference point for ``bench``: transformers' own ``generate`` on the identical workload (the
machine's own limits, the measured peak, are ``roofline.py``'s).

Invariants:
- The baseline sees the same prompt ids, greedy, with exactly ``output_len`` new tokens each
  (``min_new_tokens`` = ``max_new_tokens``), one left-padded batch, in the same process, after
  tinyllm's runs, loaded independently through transformers (GGUF dequantized by transformers).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .errors import TinyLLMError
from .model import hub
from .model.checkpoint import default_model_path


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
