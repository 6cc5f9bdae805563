"""``compare --isa avx2``: the environment, flags and builds each engine gets, the checks that
verify each cap, and how a capped run is stored (no peers needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from benchmarks import isa
from benchmarks.compare import parse_args
from benchmarks.comparison import Comparison
from benchmarks.engines.openvino import openvino_env, ov_precision
from benchmarks.engines.vllm import vllm_env
from benchmarks.machine import cpu_class
from benchmarks.results import load, record, validate, write
from benchmarks.runs import note_isa
from benchmarks.venvs import LLAMACPP_BUILDS, llamacpp_configure

ZEN5 = {"model_name": "AMD EPYC", "cores": 2, "amx": False, "avx512_bf16": True, "avx512f": True,
        "family": "26", "model": "2", "uarch": "Zen 5"}


def test_isa_defaults_to_native_and_refuses_an_unknown_one(capsys):
    assert parse_args([]).isa == "native"
    assert parse_args(["--isa", "avx2"]).isa == "avx2"
    with pytest.raises(SystemExit):
        parse_args(["--isa", "avx512"])
    assert "--isa" in capsys.readouterr().err


def test_native_changes_no_engine():
    assert isa.tinyllm_env("native") == isa.openvino_env("native") == isa.vllm_env("native") == {}
    assert isa.reexec_env("native", {}) is None
    assert isa.llamacpp_build("native") == "native"
    assert isa.capped_cpu(ZEN5, "native") == ZEN5


def test_tinyllm_gets_the_haswell_kernels_and_every_torch_library_capped():
    env = isa.tinyllm_env("avx2")
    assert env == {"TINYLLM_KERNELS_MARCH": "haswell", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                   "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def test_compare_reexecutes_until_torch_would_load_capped():
    """Torch reads its caps when it loads, so compare runs again with them; once they are in the
    environment (the re-executed process) it goes on."""
    first = isa.reexec_env("avx2", {"PATH": "/bin", "ATEN_CPU_CAPABILITY": "default"})
    assert first is not None and first["PATH"] == "/bin" and first[isa.REEXEC_MARK] == "avx2"
    assert all(first[k] == v for k, v in isa.tinyllm_env("avx2").items())
    assert isa.reexec_env("avx2", first) is None


def test_openvino_worker_gets_the_onednn_cap_and_probes_its_graph():
    assert openvino_env("avx2")["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert "ONEDNN_MAX_CPU_ISA" not in openvino_env("native") or os.environ.get("ONEDNN_MAX_CPU_ISA")


def test_openvino_runs_f32_on_the_capped_cpu_as_on_an_avx2_one():
    """On the capped host the int4 row computes as on an AVX2 CPU (no bf16 instructions: f32 and
    f32 K/V), not as the AVX512-BF16 host would (bf16)."""
    assert ov_precision("int4", ZEN5) == ("bf16", "bf16")
    assert ov_precision("int4", isa.capped_cpu(ZEN5, "avx2")) == ("f32", "f32")
    assert ov_precision("float32", isa.capped_cpu(ZEN5, "avx2")) == ("f32", "f32")


def test_vllm_worker_gets_torch_capped_and_the_site_hook_first_on_its_path():
    env = vllm_env(2, "avx2")
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["TINYLLM_BENCH_ISA"] == "avx2" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(isa.ISA_SITE)
    kept = isa.vllm_env("avx2", {"PYTHONPATH": "/somewhere"})
    assert kept["PYTHONPATH"] == f"{isa.ISA_SITE}{os.pathsep}/somewhere"
    assert "TINYLLM_BENCH_ISA" not in vllm_env(2, "native") or os.environ.get("TINYLLM_BENCH_ISA")


def _fake_torch(tmp_path):
    """A package named torch whose cpu module reports AVX-512 and AMX (the real one is not needed)."""
    pkg = tmp_path / "fake" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cpu.py").write_text("def _is_avx512_supported():\n    return True\n"
                                "def _is_avx512_bf16_supported():\n    return True\n"
                                "def _is_amx_tile_supported():\n    return True\n"
                                "def get_capabilities():\n    return {'avx512_f': True}\n")
    return tmp_path / "fake"


@pytest.mark.parametrize("cap, want", [("avx2", "False False False True"), (None, "True True True True")])
def test_site_hook_makes_torch_report_no_avx512_only_when_asked(tmp_path, cap, want):
    """The hook patches torch.cpu in any process started with it on PYTHONPATH (vLLM's spawned
    engine core included), and does nothing without TINYLLM_BENCH_ISA=avx2."""
    env = {k: v for k, v in os.environ.items() if k != "TINYLLM_BENCH_ISA"}
    env["PYTHONPATH"] = os.pathsep.join([str(isa.ISA_SITE), str(_fake_torch(tmp_path))])
    if cap:
        env["TINYLLM_BENCH_ISA"] = cap
    code = ("import torch.cpu as c; print(c._is_avx512_supported(), c._is_avx512_bf16_supported(), "
            "c._is_amx_tile_supported(), c.get_capabilities()['avx512_f'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == want


def test_llamacpp_avx2_build_is_its_own_directory_with_every_avx512_option_off(tmp_path):
    native, avx2 = llamacpp_configure(tmp_path, "native"), llamacpp_configure(tmp_path, "avx2")
    assert tmp_path / "build" in native and tmp_path / "build-avx2" in avx2
    flags = {f.split("=")[0].removeprefix("-D"): f.split("=")[1] for f in map(str, avx2) if f.startswith("-DGGML")}
    assert flags["GGML_NATIVE"] == "OFF"
    assert all(flags[k] == "ON" for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C"))
    wide = [k for k in flags if "AVX512" in k or "AMX" in k or k == "GGML_AVX_VNNI"]
    assert len(wide) >= 7 and all(flags[k] == "OFF" for k in wide)
    assert "-DGGML_NATIVE=ON" in map(str, native)
    assert "llama-server" not in LLAMACPP_BUILDS["avx2"][2] and "llama-batched-bench" in LLAMACPP_BUILDS["avx2"][2]


# llama_print_system_info() of this host's two builds
SYSTEM_INFO_AVX2 = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | "
                    "OPENMP = 1 | REPACK = 1 |")
SYSTEM_INFO_NATIVE = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
                      "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | LLAMAFILE = 1 | OPENMP = 1 | "
                      "REPACK = 1 |")


def test_llamacpp_cap_is_read_from_its_system_info():
    info = isa.llamacpp_system_info(SYSTEM_INFO_AVX2)
    assert info["AVX2"] == 1 and info["FMA"] == 1 and "AVX512" not in info
    assert isa.llamacpp_check(info)["ok"]
    wide = isa.llamacpp_check(isa.llamacpp_system_info(SYSTEM_INFO_NATIVE))
    assert not wide["ok"] and wide["uncapped"] == "AVX512, AVX512_BF16, AVX512_VBMI, AVX512_VNNI, AVX_VNNI on"
    assert not isa.llamacpp_check({})["ok"]  # printed nothing: not verified
    explicit_off = isa.llamacpp_system_info(SYSTEM_INFO_AVX2 + " AVX512 = 0 |")
    assert isa.llamacpp_check(explicit_off)["ok"]


def test_openvino_check_names_what_ran_avx512_and_what_mlas_ran():
    counts = {"Eltwise jit_avx2_f32": 90, "FullyConnected brgemm_avx2_f32": 30, "FullyConnected gemm_mlas_f32": 181,
              "RMS jit_avx512_f32": 61, "RoPE ref_any_f32": 60}
    c = isa.openvino_check(counts)
    assert not c["ok"]
    assert c["nodes_by_isa"]["avx2"] == 120 and c["nodes_by_isa"]["avx512"] == 61 and c["nodes_by_isa"]["other"] == 60
    assert "61 RMS jit_avx512_f32" in c["uncapped"] and "181 FullyConnected gemm_mlas_f32" in c["uncapped"]
    assert isa.openvino_check({"Eltwise jit_avx2_f32": 3, "RoPE ref_any_f32": 2})["ok"]


def test_vllm_check_wants_only_the_avx2_ops_and_torch_capped():
    capped = {"torch_cpu_capability": "AVX2", "onednn_isa": "Intel AVX2", "mkl_isa": "x"}
    ok = isa.vllm_check({"vllm_c_libs": ["_C_AVX2.abi3.so"]}, capped)
    assert ok["ok"] and "uncapped" not in ok
    wide = isa.vllm_check({"vllm_c_libs": ["_C.abi3.so"]}, capped | {"onednn_isa": "Intel AVX-512 with Intel DL Boost"})
    assert not wide["ok"] and "_C.abi3.so" in wide["uncapped"] and "oneDNN Intel AVX-512" in wide["uncapped"]
    assert not isa.vllm_check({"vllm_c_libs": []}, capped)["ok"]


def test_a_capped_run_is_a_class_of_its_own():
    assert cpu_class(ZEN5) == "Zen 5 · AVX-512 + AVX512-BF16, no AMX"
    assert cpu_class(ZEN5 | {"isa_cap": "avx2"}) == "Zen 5 · AVX2 + FMA paths on an AVX-512 + AVX512-BF16, no AMX host"


class _Checked:
    def __init__(self, check):
        self.check, self.calls = check, 0

    def isa_check(self):
        self.calls += 1
        return self.check


def test_each_engine_is_verified_once_and_only_under_a_cap(capsys):
    cmp = Comparison(parse_args(["--isa", "avx2"]), ZEN5)
    eng = _Checked({"ok": False, "uncapped": "61 RMS jit_avx512_f32"})
    note_isa(cmp, "openvino", eng)
    note_isa(cmp, "openvino", eng)
    assert eng.calls == 1 and cmp.isa_checks["openvino"]["ok"] is False
    assert "OpenVINO GenAI --isa avx2: not capped: 61 RMS jit_avx512_f32" in capsys.readouterr().err
    later = _Checked(None)  # llama.cpp before its first run printed anything
    note_isa(cmp, "llamacpp", later)
    assert "llamacpp" not in cmp.isa_checks
    native = Comparison(parse_args([]), ZEN5)
    note_isa(native, "openvino", eng)
    assert native.isa_checks == {} and eng.calls == 1


def test_a_capped_result_records_how_each_engine_was_capped_and_the_host_limits(tmp_path):
    cmp = Comparison(parse_args(["--isa", "avx2"]), ZEN5)
    cmp.cell("W1", "float32", "tinyllm").values.append(100.0)
    cmp.cell("W1", "float32", "openvino").values.append(90.0)
    cmp.isa_checks["tinyllm"] = {"ok": True, "panel_isa": "avx2"}
    cmp.host_limits = {"1t": {"fma_gflops": 130.0}}
    cmp.limits[("135m", "W1", "float32")] = {"flops_per_token": 2.7e8}
    rec = record(cmp, ["--isa", "avx2"], datetime(2026, 12, 6, 6, 0, tzinfo=timezone.utc), "abc1234")
    validate(rec, "the record")
    assert rec["settings"]["isa"] == "avx2" and rec["cpu"]["isa_cap"] == "avx2"
    assert rec["isa"]["engines"]["tinyllm"]["ok"] is True and "haswell" in rec["isa"]["engines"]["tinyllm"]["how"]
    assert rec["isa"]["engines"]["openvino"]["ok"] is None  # never verified: said so, not guessed
    assert rec["host_limits"]["1t"]["fma_gflops"] == 130.0
    assert rec["limits"]["135m/W1/float32"]["flops_per_token"] == 2.7e8
    [stored] = load(write(rec, tmp_path).parent)
    assert "avx2-fma-paths" in stored.path.name
    native = record(Comparison(parse_args([]), ZEN5), [], datetime(2026, 12, 6, tzinfo=timezone.utc), None)
    assert "isa" not in native and "isa_cap" not in native["cpu"] and native["settings"]["isa"] == "native"


def test_an_engine_left_uncapped_runs_natively_and_its_record_says_so(capsys):
    """--uncapped: an engine that cannot run capped (OpenVINO's int4 row) runs its native paths;
    the record names it as not capped rather than leaving the row out silently."""
    a = parse_args(["--isa", "avx2", "--uncapped", "openvino"])
    assert a.uncapped == ["openvino"]
    assert isa.engine_isa(a.isa, "openvino", a.uncapped) == "native"
    assert isa.engine_isa(a.isa, "vllm", a.uncapped) == "avx2"
    for bad in (["--uncapped", "openvino"], ["--isa", "avx2", "--uncapped", "tinyllm"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    assert "--uncapped" in capsys.readouterr().err
    cmp = Comparison(a, ZEN5)
    cmp.cell("W1", "int4", "openvino").values.append(90.0)
    cmp.isa_checks["openvino"] = isa.openvino_check({"FullyConnected gemm_mlas_f32": 3, "RMS jit_avx512_f32": 2})
    rec = record(cmp, [], datetime(2026, 12, 6, tzinfo=timezone.utc), None)
    ov = rec["isa"]["engines"]["openvino"]
    assert ov["how"] == isa.UNCAPPED_HOW and ov["ok"] is False and rec["isa"]["uncapped"] == ["openvino"]


def test_an_uncapped_worker_gets_none_of_the_caps_compare_set_for_itself(monkeypatch):
    """compare re-executes itself with torch's caps; a worker it leaves uncapped must not inherit
    them (OpenVINO's oneDNN would still be capped), while a cap the user set stays theirs."""
    capped_compare = isa.reexec_env("avx2", {"PATH": "/bin"})
    monkeypatch.setattr(os, "environ", capped_compare)
    ov_native, ov_capped = openvino_env("native"), openvino_env("avx2")
    assert "ONEDNN_MAX_CPU_ISA" not in ov_native and "ATEN_CPU_CAPABILITY" not in ov_native
    assert ov_native["PATH"] == "/bin" and isa.REEXEC_MARK not in ov_native
    assert ov_capped["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert "ATEN_CPU_CAPABILITY" not in vllm_env(1, "native") and vllm_env(1, "avx2")["ATEN_CPU_CAPABILITY"] == "avx2"
    users_own = {"PATH": "/bin", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}  # no compare cap: left alone
    assert isa.worker_env(users_own, "native") == users_own
