"""OpenVINO GenAI: its models exported by optimum-cli (fp32, or NNCF int4), driven by a warm
worker per row (``workers/openvino_worker.py``) with every CPU-plugin precision set explicitly."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .. import isa
from ..common import INT4, Skip, log
from ..guard import WorkerEngine
from ..venvs import run_logged

OV_WORKER = Path(__file__).resolve().parent.parent / "workers" / "openvino_worker.py"


def openvino_export(py: Path, hf_dir: Path, out: Path, weight_format: str, group_size: int, logfile: Path) -> Path:
    """``optimum-cli export openvino`` of an HF directory: ``fp32`` weights (the f32 and bf16 rows
    share them: the bf16 row's precision is the runtime's INFERENCE_PRECISION_HINT) or NNCF's
    data-free ``int4`` (asymmetric, ``group_size`` columns per scale where that divides the row,
    else the group size NNCF adjusts to, every layer in 4 bits (ratio 1.0); NNCF keeps the
    embedding and output layer in int8, its backup precision)."""
    if (out / "openvino_model.xml").exists():
        return out
    log(f"exporting {hf_dir.name} to OpenVINO ({weight_format}; log: {logfile}) ...")
    cli = py.parent / "optimum-cli"
    cmd = [cli, "export", "openvino", "--model", hf_dir, "--task", "text-generation-with-past",
           "--weight-format", weight_format]
    if weight_format == "int4":
        # 135M's hidden size (576) is no multiple of 128: NNCF then picks the nearest group size
        # that divides the row ("adjust") instead of refusing the model.
        cmd += ["--group-size", str(group_size), "--group-size-fallback", "adjust", "--ratio", "1.0"]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if not run_logged([*cmd, tmp], logfile, env=env) or not (tmp / "openvino_model.xml").exists():
        raise Skip(f"optimum-cli export openvino --weight-format {weight_format} failed (see {logfile})")
    tmp.rename(out)
    return out


# The OpenVINO CPU plugin's settings per row: (INFERENCE_PRECISION_HINT, KV_CACHE_PRECISION). The
# int4 row computes in bf16 with bf16 K/V, as tinyllm's 4-bit row does (configs/fast.yaml).
OV_PRECISION = {"float32": ("f32", "f32"), "bfloat16": ("bf16", "bf16"), INT4: ("bf16", "bf16")}


def ov_precision(dtype: str, cpu: dict) -> tuple[str, str]:
    """The row's OpenVINO settings on this CPU (as capped: isa.capped_cpu). Without bf16
    instructions (no AVX512-BF16 or AMX: AVX2 builds) OpenVINO's paged attention takes only f32 K/V ("expect kvcache type f32"), so
    there the int4 row computes in f32 with f32 K/V; the bf16 row stays as asked (it cannot run
    there, and the table says so)."""
    if dtype == INT4 and not (cpu["avx512_bf16"] or cpu["amx"]):
        return "f32", "f32"
    return OV_PRECISION[dtype]


class OpenVINOEngine(WorkerEngine):
    """OpenVINO GenAI's ``ContinuousBatchingPipeline.generate`` in workers/openvino_worker.py."""

    name = "OpenVINO GenAI"

    def __init__(self, py: Path, ov_dir: Path, precisions: tuple[str, str], logfile: Path, kv_gib: int,
                 timeout: float, isa_name: str = "native", probe: bool = False):
        precision, kv_precision = precisions  # ov_precision's
        cmd = [str(py), str(OV_WORKER), "serve", "--model", str(ov_dir), "--precision", precision,
               "--kv-precision", kv_precision, "--kv-gb", str(kv_gib), "--threads", "2"]
        cmd += ["--probe-isa"] if probe or isa_name != "native" else []
        super().__init__(cmd, openvino_env(isa_name), logfile, timeout)

    def isa_check(self) -> dict | None:
        """What the worker's probe saw of the --isa cap (isa.openvino_check); None when it did not probe."""
        return isa.openvino_check(self.info["primitive_types"]) if "primitive_types" in self.info else None


def openvino_env(isa_name: str) -> dict:
    return isa.worker_env(os.environ, isa_name) | {"PYTHONUNBUFFERED": "1"} | isa.openvino_env(isa_name)
