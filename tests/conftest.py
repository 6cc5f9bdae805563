"""Shared fixtures: tiny random Llama / Qwen2 checkpoints saved by transformers (the independent
reference), and the real default model loaded once per session; and ``wait_s``, the one bound on
every wait for something that will happen (a subprocess, a result line, a process to stop).

Bounded waits are not deadlines: a test that hits one has hung, whatever the host. Each base
figure is a few times what the wait takes on an idle development host, and ``wait_s`` scales it
by ``TIMEOUT_SCALE``: ``TINYLLM_TEST_TIMEOUT_SCALE`` where set, else this host's measured
slowness at the session's start (CPU time of a fixed Python loop over the development host's;
never below 1), so a slower interpreter gets proportionally longer bounds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import settings

# No per-example deadline: CI machines are shared and noisy, and a slow example is not a bug.
settings.register_profile("tinyllm", deadline=None, print_blob=True)
settings.load_profile("tinyllm")

from tinyllm_cli.model.checkpoint import load_checkpoint
from tinyllm_cli.model.llama import build_model

torch.set_num_threads(2)

# CPU seconds of ``_python_loop()`` on the development host (AMD EPYC, Python 3, idle or busy alike:
# CPU time does not count the waits for a shared core).
REFERENCE_LOOP_CPU_S = 0.036
TIMEOUT_SCALE = 1.0
_SCALE_SOURCE = "not measured yet"


def _python_loop() -> float:
    start = time.process_time()
    x = 0
    for i in range(1_000_000):
        x += i * i % 7
    return time.process_time() - start


def timeout_scale() -> tuple[float, str]:
    """(scale, where it came from): the environment's TINYLLM_TEST_TIMEOUT_SCALE, else measured."""
    given = os.environ.get("TINYLLM_TEST_TIMEOUT_SCALE")
    if given is not None:
        try:
            scale = float(given)
        except ValueError:
            scale = 0.0
        if not scale > 0:
            raise pytest.UsageError(f"TINYLLM_TEST_TIMEOUT_SCALE must be a positive number, not {given!r}")
        return scale, "TINYLLM_TEST_TIMEOUT_SCALE"
    measured = min(_python_loop() for _ in range(3))
    return max(1.0, measured / REFERENCE_LOOP_CPU_S), f"this host's Python loop took {measured:.3f} CPU s"


def wait_s(seconds: float) -> float:
    """The bound on a wait that takes a fraction of ``seconds`` on the development host, on this one."""
    return seconds * TIMEOUT_SCALE


def pytest_configure(config):
    global TIMEOUT_SCALE, _SCALE_SOURCE
    TIMEOUT_SCALE, _SCALE_SOURCE = timeout_scale()
    config.addinivalue_line("markers", "needs_kernels: calls tinyllm's CPU kernels: fails where they should "
                                       "have built and did not, skips where they are not expected")


def pytest_report_header(config):
    return f"bounded waits scaled x{TIMEOUT_SCALE:.2f} ({_SCALE_SOURCE})"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    # In the call phase, not setup, so that a build that should have worked reports the test as
    # failed rather than as an error in a fixture.
    if item.get_closest_marker("needs_kernels"):
        require_kernels()


def require_kernels() -> None:
    """Return where the kernels are loaded. Where they did not build, fail the test if they were
    expected (a C++ compiler is here and nobody opted out; kernels.expected()), since a skip there
    would let a broken build pass as a machine without a compiler; otherwise skip it."""
    from tinyllm_cli import kernels

    if kernels.load():  # built (or loaded) once per process, on the first test that needs them
        return
    if kernels.expected():
        pytest.fail(f"tinyllm's CPU kernels did not build ({kernels.load_error()}) although a C++ compiler is "
                    f"here ({kernels.compiler()}); set TINYLLM_ALLOW_NO_KERNELS=1 to accept the PyTorch path",
                    pytrace=False)
    pytest.skip(f"tinyllm's CPU kernels did not build ({kernels.load_error()}); "
                f"{kernels.opted_out() or 'no C++ compiler here'}")


def _save_random(path, cfg_cls, **kw):
    import transformers

    torch.manual_seed(0)
    cfg = cfg_cls(**kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    # Random init gives near-uniform logits; scale weights up so greedy decoding is not decided by
    # float noise, which would make token-for-token comparisons meaningless.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


LLAMA_SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   bos_token_id=1, eos_token_id=2)
QWEN2_SHAPE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                   rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                   bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="session", autouse=True)
def peak_cache(tmp_path_factory):
    """bench measures this CPU's peak by default (roofline.py): the tests' measurements go to a
    cache of their own, never the user's ~/.cache."""
    os.environ["TINYLLM_PEAK_CACHE"] = str(tmp_path_factory.mktemp("peak") / "peak.json")


def run_without_kernels(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` with TINYLLM_KERNELS=0, in a fresh process (kernels load once per
    process); it must exit 0."""
    env = {**os.environ, "TINYLLM_KERNELS": "0"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=wait_s(120))
    assert p.returncode == 0, p.stderr
    return p


@pytest.fixture
def no_bf16_onednn(monkeypatch):
    """oneDNN without bfloat16 matmuls, as on a CPU lacking AVX512-BF16 and AMX (float32 still
    runs), so the ``onednn-f32`` path is tested on every CPU."""
    from tinyllm_cli.model import gemm
    real = gemm.onednn_usable
    monkeypatch.setattr(gemm, "onednn_usable", lambda dtype, device: dtype != torch.bfloat16 and real(dtype, device))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    import transformers
    return _save_random(tmp_path_factory.mktemp("llama"), transformers.LlamaConfig, **LLAMA_SHAPE)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    import transformers
    return _save_random(tmp_path_factory.mktemp("qwen2"), transformers.Qwen2Config, **QWEN2_SHAPE)


@pytest.fixture(scope="session")
def tiny_model(llama_dir):
    ck = load_checkpoint(str(llama_dir), progress=False)
    return build_model(ck.config, ck.weights, torch.float32, "cpu")


@pytest.fixture(scope="session")
def default_checkpoint():
    return load_checkpoint(None, progress=False)


@pytest.fixture(scope="session")
def default_model(default_checkpoint):
    ck = default_checkpoint
    return build_model(ck.config, ck.weights, torch.float32, "cpu")
