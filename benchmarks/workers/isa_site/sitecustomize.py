"""Loaded at start-up by every Python process whose PYTHONPATH starts with this directory (a
peer's worker under ``compare --isa avx2``, and the processes it spawns, which inherit the
environment). With ``TINYLLM_BENCH_ISA=avx2`` it makes torch's AVX-512 and AMX probes
(``torch.cpu._is_avx512_supported`` and the like) answer False once ``torch.cpu`` is imported, so
code that picks its kernels by them (vLLM CPU: ``_C_AVX2`` rather than ``_C`` / ``_C_AVX512``,
and its attention ISA) takes its AVX2 path. Otherwise it does nothing.

It imports nothing heavy: a finder on ``sys.meta_path`` waits for ``torch.cpu`` and patches the
module right after it executes.
"""

import importlib.abc
import importlib.util
import os
import sys

PROBES = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
          "_is_amx_tile_supported", "_is_amx_fp16_supported")


class _CapTorchCpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)  # find the real spec, then patch its loader
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for probe in PROBES:
                if hasattr(module, probe):
                    setattr(module, probe, lambda: False)
        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TINYLLM_BENCH_ISA") == "avx2":
    sys.meta_path.insert(0, _CapTorchCpu())
