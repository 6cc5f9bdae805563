"""Small or malformed checkpoints: one sentence, exit 2, and nothing big allocated first.

Valid tiny files are built the way the project builds them elsewhere (``gguf.GGUFWriter`` as in
``test_gguf_roundtrip``; the ``llama_dir`` safetensors directory from ``conftest``), then
corrupted: truncated at several points, tensor offsets rewritten in the header so a hundred
entries read the same bytes (or two overlap, or one runs past the end), tensors for layers the
model does not have, wrong shapes, names the model does not use, shard names and symlinks
leading out of the model directory. Every case also runs through ``tinyllm_cli.cli.main``:
exit 2, exactly one line on stderr, nothing on stdout, no traceback.

"Nothing big allocated first" is measured, not assumed: in process, the bytes handed to the
``gguf`` dequantizer (or tensors read from safetensors) before the error; for the aliasing
attack, the peak RSS of a fresh subprocess around the load (the loader before this check grew
it by ~105 MiB for a 1 MiB file).

Memory: ``machine.host_available_memory`` is monkeypatched to a small number; the refusal (exit 1:
the checkpoint is fine, the machine is short) names the need, computed here independently from
the tensor shapes for each quant mode and dtype, and what is available.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tinyllm_cli.cli import main
from tinyllm_cli.errors import CheckpointError
from tinyllm_cli import machine
from tinyllm_cli.model import hub, validate
from tinyllm_cli.model.checkpoint import load_checkpoint
from conftest import wait_s

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

SHAPE = dict(vocab=64, hidden=64, heads=4, kv_heads=2, ffn=128, layers=2)
SUB_ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))


# ---- building valid files -----------------------------------------------------------------------

def gguf_tensors(layers: int = SHAPE["layers"], seed: int = 0) -> dict[str, np.ndarray]:
    """llama.cpp names -> float32 arrays, outermost dimension first (the writer reverses them)."""
    rng = np.random.default_rng(seed)
    h, v, f = SHAPE["hidden"], SHAPE["vocab"], SHAPE["ffn"]
    kv = SHAPE["kv_heads"] * h // SHAPE["heads"]
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "output.weight": (v, h)}
    for n in range(layers):
        shapes |= {f"blk.{n}.attn_norm.weight": (h,), f"blk.{n}.ffn_norm.weight": (h,),
                   f"blk.{n}.attn_q.weight": (h, h), f"blk.{n}.attn_k.weight": (kv, h),
                   f"blk.{n}.attn_v.weight": (kv, h), f"blk.{n}.attn_output.weight": (h, h),
                   f"blk.{n}.ffn_gate.weight": (f, h), f"blk.{n}.ffn_up.weight": (f, h),
                   f"blk.{n}.ffn_down.weight": (h, f)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def write_gguf(path: Path, tensors: dict, block_count: int = SHAPE["layers"], hidden: int = SHAPE["hidden"],
               ffn: int = SHAPE["ffn"]) -> Path:
    """``tensors``: name -> array, or (array, raw_dtype, raw_shape) for quantized / mis-declared ones."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_embedding_length(hidden)
    w.add_head_count(SHAPE["heads"])
    w.add_head_count_kv(SHAPE["kv_heads"])
    w.add_feed_forward_length(ffn)
    w.add_context_length(128)
    w.add_vocab_size(SHAPE["vocab"])
    for name, t in tensors.items():
        data, raw_dtype, raw_shape = t if isinstance(t, tuple) else (t, None, None)
        w.add_tensor(name, data, raw_shape=raw_shape, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def info_at(data: bytes, name: str) -> int:
    """Where tensor ``name``'s info starts in the header: its length-prefixed name is unique
    there (found by bytes, not by a reader: the corrupted files must not need to parse)."""
    return data.index(struct.pack("<Q", len(name)) + name.encode())


def offset_field(data: bytes, name: str) -> tuple[int, int]:
    """(position, value) of tensor ``name``'s data offset: after the name, the dimension count,
    the dimensions and the type (GGUF v3 tensor info)."""
    pos = info_at(data, name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, pos)[0]
    pos += 4 + 8 * n_dims + 4
    return pos, struct.unpack_from("<Q", data, pos)[0]


def offset_of(path: Path, name: str) -> int:
    return offset_field(path.read_bytes(), name)[1]


def set_offsets(path: Path, new: dict[str, int]) -> None:
    data = bytearray(path.read_bytes())
    for name, offset in new.items():
        struct.pack_into("<Q", data, offset_field(data, name)[0], offset)
    path.write_bytes(bytes(data))


@pytest.fixture
def good_gguf(tmp_path) -> Path:
    return write_gguf(tmp_path / "good.gguf", gguf_tensors())


# ---- running the loader -------------------------------------------------------------------------

@pytest.fixture
def dequantized(monkeypatch) -> list[int]:
    """Bytes of tensor data handed to gguf's dequantizer (the loader imports it at call time)."""
    import gguf.quants
    seen, real = [], gguf.quants.dequantize

    def counting(data, qtype):
        seen.append(int(np.asarray(data).nbytes))
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    return seen


@pytest.fixture
def st_reads(monkeypatch) -> list[str]:
    """Names of tensors read out of safetensors files."""
    import safetensors
    seen, real = [], safetensors.safe_open

    class Counting:
        def __init__(self, *a, **kw):
            self.inner = real(*a, **kw)

        def __enter__(self):
            self.st = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.st.keys()

        def get_tensor(self, name):
            seen.append(name)
            return self.st.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Counting)
    return seen


def cli_load(capsys, tmp_path, model) -> tuple[int, str, str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [5, 6], "max_new_tokens": 1}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["generate", "-p", str(prompts), "--model", str(model), "-q"])
    out, err = capsys.readouterr()
    return e.value.code, out, err


def assert_one_sentence(code: int, out: str, err: str, needle: str, want_code: int = 2) -> None:
    assert code == want_code, err
    assert out == ""
    assert err.startswith("error: ") and err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert needle in err, err


def test_valid_files_load(good_gguf, llama_dir, capsys, tmp_path):
    """The corruptions below start from files that load and run."""
    ck = load_checkpoint(str(good_gguf), progress=False)
    assert len(ck.weights) == len(gguf_tensors())
    code, out, err = cli_load(capsys, tmp_path, good_gguf)
    assert code == 0 and len(out.splitlines()) == 1, err
    code, out, err = cli_load(capsys, tmp_path, llama_dir)
    assert code == 0 and len(out.splitlines()) == 1, err


# ---- GGUF: truncated ----------------------------------------------------------------------------

def test_truncated_gguf_is_one_sentence_exit_2(good_gguf, capsys, tmp_path, dequantized):
    data = good_gguf.read_bytes()
    first_info = info_at(data, "token_embd.weight") + 12  # inside the first tensor's info
    data_start = len(data) - sum(t.nbytes for t in gguf_tensors().values())  # all sizes are 32-aligned
    cuts = [4, 12, 30, first_info, data_start - 1, data_start, data_start + 1000, len(data) - 1]
    for cut in cuts:
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(data[:cut])
        code, out, err = cli_load(capsys, tmp_path, short)
        assert_one_sentence(code, out, err, "truncated or corrupt")
        assert f"({cut} bytes)" in err
    assert sum(dequantized) == 0


# ---- GGUF: aliasing, overlap, bounds, alignment ------------------------------------------------

def aliased_gguf(path: Path, copies: int = 100) -> Path:
    """``copies`` layers whose ffn_up all point at layer 0's 1 MiB of data: a ~1 MiB file that
    dequantizes to ``copies`` MiB. The other tensors the config needs are absent on purpose
    (an attacker need not supply them)."""
    up = np.ones((1024, 256), dtype=np.float32)  # 1 MiB
    tensors = {"blk.0.ffn_up.weight": up}
    for n in range(1, copies):  # declared 1024 x 256, 32 bytes written; the offset is rewritten
        tensors[f"blk.{n}.ffn_up.weight"] = (np.zeros(8, dtype=np.float32), None, (1024, 256))
    write_gguf(path, tensors, block_count=copies, hidden=256, ffn=1024)
    target = offset_of(path, "blk.0.ffn_up.weight")
    set_offsets(path, {f"blk.{n}.ffn_up.weight": target for n in range(1, copies)})
    return path


def test_aliased_tensor_data_is_refused_before_any_dequantization(tmp_path, capsys, dequantized):
    path = aliased_gguf(tmp_path / "aliased.gguf")
    assert path.stat().st_size < (1 << 20) + 65536
    code, out, err = cli_load(capsys, tmp_path, path)
    assert_one_sentence(code, out, err, "share data bytes")
    assert "blk.0.ffn_up.weight" in err and "truncated or corrupt" in err
    assert sum(dequantized) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB is Linux's")
def test_aliased_tensor_data_does_not_grow_memory(tmp_path):
    """A fresh process's peak RSS across the load: the old loader grew it by ~1 MiB per alias."""
    path = aliased_gguf(tmp_path / "aliased.gguf")
    script = (
        "import json, resource, sys\n"
        "import gguf.quants, numpy, torch\n"
        "from tinyllm_cli.model.checkpoint import load_checkpoint\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    load_checkpoint(sys.argv[1], progress=False)\n"
        "    err, code = None, None\n"
        "except Exception as e:\n"
        "    err, code = str(e), getattr(e, 'exit_code', None)\n"
        "grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
        "print(json.dumps({'err': err, 'code': code, 'grown_kib': grown}))\n")
    p = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                       env=SUB_ENV, cwd=Path(__file__).parents[1], timeout=wait_s(300))
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["err"] and "share data bytes" in res["err"] and res["code"] == 2
    assert res["grown_kib"] < 8 * 1024, f"peak RSS grew by {res['grown_kib'] / 1024:.1f} MiB"


def _overlap(path: Path) -> str:
    set_offsets(path, {"blk.0.attn_k.weight": offset_of(path, "blk.0.attn_q.weight") + 4096})  # q is 16 KiB
    return "share data bytes"


def _past_end(path: Path) -> str:
    set_offsets(path, {"blk.1.ffn_down.weight": path.stat().st_size})
    return "runs past the end of the file"


def _misaligned(path: Path) -> str:
    set_offsets(path, {"blk.0.attn_k.weight": offset_of(path, "blk.0.attn_k.weight") + 4})
    return "not a multiple of the alignment"


def _duplicate_name(path: Path) -> str:
    data = path.read_bytes()
    i = data.index(b"blk.1.attn_k.weight")  # the header's only spelling of it; same length as q
    path.write_bytes(data[:i] + b"blk.1.attn_q.weight" + data[i + 19:])
    return "listed twice"


def _huge_dims(path: Path) -> str:
    t = gguf_tensors()
    t["blk.0.ffn_up.weight"] = (np.zeros(8, dtype=np.float32), None, (1 << 32, 1 << 32))  # 2**64 wraps int64
    write_gguf(path, t)
    return "runs past the end of the file"


def _layer_past_block_count(path: Path) -> str:
    write_gguf(path, gguf_tensors() | {"blk.99.attn_norm.weight": np.ones(SHAPE["hidden"], np.float32)})
    return "is for layer 99, but the model has 2 layers (block_count = 2)"


def _many_layers_past_block_count(path: Path) -> str:
    extra = {f"blk.{n}.ffn_up.weight": np.ones((SHAPE["ffn"], SHAPE["hidden"]), np.float32) for n in range(2, 40)}
    write_gguf(path, gguf_tensors() | extra)
    return "blk.2.ffn_up.weight in GGUF file"


def _wrong_shape(path: Path) -> str:
    t = gguf_tensors()
    t["blk.1.attn_q.weight"] = np.ones((SHAPE["hidden"], 32), np.float32)
    write_gguf(path, t)
    return "tensor blk.1.attn_q.weight in GGUF file"


def _unknown_name(path: Path) -> str:
    write_gguf(path, gguf_tensors() | {"mystery.weight": np.ones(8, np.float32)})
    return "tensor named 'mystery.weight', which is not part of a llama model"


def _foreign_bias(path: Path) -> str:
    write_gguf(path, gguf_tensors() | {"blk.1.attn_output.bias": np.ones(SHAPE["hidden"], np.float32)})
    return "tensor named 'blk.1.attn_output.bias', which is not part of a llama model"


def _bias_config_lacks(path: Path) -> str:
    write_gguf(path, gguf_tensors() | {"blk.1.attn_q.bias": np.ones(SHAPE["hidden"], np.float32)})
    return "blk.1.attn_q.bias in GGUF file"  # blk.0 has none, so the config has no attention bias


def _missing_tensor(path: Path) -> str:
    t = gguf_tensors()
    del t["blk.1.ffn_down.weight"]
    write_gguf(path, t)
    return "lacks tensor blk.1.ffn_down.weight, which the model config requires"


def _bad_rope_freqs(path: Path) -> str:
    write_gguf(path, gguf_tensors() | {"rope_freqs.weight": np.ones(4096, np.float32)})
    return "rope_freqs.weight has shape [4096], not the [8] a head of 16 needs"


GGUF_CASES = {"overlap": _overlap, "past-end": _past_end, "misaligned": _misaligned,
              "duplicate-name": _duplicate_name, "huge-dims": _huge_dims,
              "layer-past-block-count": _layer_past_block_count,
              "many-layers-past-block-count": _many_layers_past_block_count,
              "wrong-shape": _wrong_shape, "unknown-name": _unknown_name, "foreign-bias": _foreign_bias,
              "bias-config-lacks": _bias_config_lacks,
              "missing-tensor": _missing_tensor, "bad-rope-freqs": _bad_rope_freqs}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_corrupt_gguf_is_refused_before_dequantizing(case, good_gguf, capsys, tmp_path, dequantized):
    needle = GGUF_CASES[case](good_gguf)
    code, out, err = cli_load(capsys, tmp_path, good_gguf)
    assert_one_sentence(code, out, err, needle)
    assert sum(dequantized) == 0, f"{sum(dequantized)} bytes dequantized before the error"


def test_an_absurd_layer_count_costs_nothing_before_the_error(tmp_path):
    """A 330 KB file whose metadata claims 100,000 layers: the check's memory grows with the
    tensors the file holds, not with the layers it claims (a per-layer name list would be 1.4M
    strings, over 100 MB)."""
    import tracemalloc
    path = write_gguf(tmp_path / "deep.gguf", gguf_tensors(), block_count=100_000)
    tracemalloc.start()
    try:
        with pytest.raises(validate.BadCheckpoint, match=r"lacks tensor blk\.2\.attn_q\.weight and 899981 more"):
            load_checkpoint(str(path), progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB traced"


def test_wrong_shape_sentence_names_both_shapes(good_gguf):
    _wrong_shape(good_gguf)
    with pytest.raises(validate.BadCheckpoint, match=r"has shape \[64, 32\] but the model config implies \[64, 64\]"):
        load_checkpoint(str(good_gguf), progress=False)


# ---- safetensors directories --------------------------------------------------------------------

def hf_copy(src, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def st_edit_header(path: Path, edit) -> None:
    """Rewrite a safetensors header in place (``edit`` mutates the dict), data bytes unchanged."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


def st_edit_tensors(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_truncated_safetensors_is_one_sentence_exit_2(llama_dir, capsys, tmp_path, st_reads):
    d = hf_copy(llama_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    for cut in (0, 5, 8, 8 + n // 2, 8 + n, 8 + n + 100, len(data) // 2, len(data) - 1):
        (d / "model.safetensors").write_bytes(data[:cut])
        code, out, err = cli_load(capsys, tmp_path, d)
        assert_one_sentence(code, out, err, "truncated or corrupt")
    assert st_reads == []


def _st_alias(d: Path) -> str:
    def edit(h):
        k, v = h["model.layers.0.self_attn.k_proj.weight"], h["model.layers.0.self_attn.v_proj.weight"]
        v["data_offsets"] = k["data_offsets"]
    st_edit_header(d / "model.safetensors", edit)
    return "share data bytes"


def _st_overlap(d: Path) -> str:
    def edit(h):
        b, e = h["model.layers.0.self_attn.k_proj.weight"]["data_offsets"]
        h["model.layers.0.self_attn.v_proj.weight"]["data_offsets"] = [b + 512, e + 512]
    st_edit_header(d / "model.safetensors", edit)
    return "share data bytes"


def _st_size_mismatch(d: Path) -> str:
    def edit(h):
        h["model.norm.weight"]["shape"] = [1 << 40]
    st_edit_header(d / "model.safetensors", edit)
    return "tensor model.norm.weight has 256 data bytes but its shape"


def _st_layer_past_count(d: Path) -> str:
    st_edit_tensors(d / "model.safetensors",
                    lambda t: t.update({"model.layers.99.input_layernorm.weight": torch.ones(64)}))
    return "is for layer 99, but the model has 3 layers (num_hidden_layers = 3)"


def _st_unknown_name(d: Path) -> str:
    st_edit_tensors(d / "model.safetensors", lambda t: t.update({"model.mystery.weight": torch.ones(4)}))
    return "'model.mystery.weight', which is not part of a llama model"


def _st_wrong_shape(d: Path) -> str:
    st_edit_tensors(d / "model.safetensors",
                    lambda t: t.update({"model.layers.2.mlp.down_proj.weight": torch.ones(64, 16)}))
    return "has shape [64, 16] but the model config implies [64, 160]"


def _st_integer(d: Path) -> str:
    st_edit_tensors(d / "model.safetensors",
                    lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}))
    return "has type int32; only floating-point weights are supported"


def _st_missing(d: Path) -> str:
    st_edit_tensors(d / "model.safetensors", lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"))
    return "lacks tensor model.layers.1.self_attn.o_proj.weight"


def _outside_relative(d: Path) -> str:
    shutil.move(d / "model.safetensors", d.parent / "outside.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "../outside.safetensors"}}))
    return "'../outside.safetensors'"


def _outside_absolute(d: Path) -> str:
    target = d.parent / "elsewhere.safetensors"
    shutil.move(d / "model.safetensors", target)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": str(target.resolve())}}))
    return "is not a file name inside the model directory"


def _outside_symlink(d: Path) -> str:
    target = d.parent / "linked.safetensors"
    shutil.move(d / "model.safetensors", target)
    (d / "model.safetensors").symlink_to(target)
    return "outside the model directory"


def _outside_symlinked_shard(d: Path) -> str:
    target = d.parent / "linked.safetensors"
    shutil.move(d / "model.safetensors", target)
    (d / "shard-1.safetensors").symlink_to(target)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "shard-1.safetensors"}}))
    return "is a link to"


ST_CASES = {"alias": _st_alias, "overlap": _st_overlap, "size-mismatch": _st_size_mismatch,
            "layer-past-count": _st_layer_past_count, "unknown-name": _st_unknown_name,
            "wrong-shape": _st_wrong_shape, "integer": _st_integer, "missing": _st_missing,
            "index-relative-outside": _outside_relative, "index-absolute": _outside_absolute,
            "symlink-outside": _outside_symlink, "index-symlinked-shard": _outside_symlinked_shard}


@pytest.mark.parametrize("case", list(ST_CASES))
def test_corrupt_safetensors_dir_is_refused_before_reading(case, llama_dir, capsys, tmp_path, st_reads):
    d = hf_copy(llama_dir, tmp_path / "model")
    needle = ST_CASES[case](d)
    code, out, err = cli_load(capsys, tmp_path, d)
    assert_one_sentence(code, out, err, needle)
    assert st_reads == [], f"{len(st_reads)} tensors read before the error"


def test_symlinks_inside_the_directory_and_the_hub_cache_layout_still_load(llama_dir, tmp_path):
    """The containment check follows links, so it must not refuse the two legitimate layouts:
    a link within the directory, and huggingface_hub's snapshot -> ../../blobs links."""
    d = hf_copy(llama_dir, tmp_path / "inside")
    (d / "real").mkdir()
    shutil.move(d / "model.safetensors", d / "real" / "w.safetensors")
    (d / "model.safetensors").symlink_to(Path("real") / "w.safetensors")
    assert len(load_checkpoint(str(d), progress=False).weights) > 0

    repo = tmp_path / "hub" / "models--org--tiny"
    snap = hf_copy(llama_dir, repo / "snapshots" / ("c" * 40))
    (repo / "blobs").mkdir()
    shutil.move(snap / "model.safetensors", repo / "blobs" / "abc123")
    (snap / "model.safetensors").symlink_to(Path("..") / ".." / "blobs" / "abc123")
    assert len(load_checkpoint(str(snap), progress=False).weights) > 0


def test_hub_downloads_only_plain_shard_names(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001.safetensors", "b": "../outside.safetensors", "c": "/etc/passwd",
        "d": "*.bin", "e": "sub/model-00002.safetensors", "f": "C:\\x.safetensors"}}))
    assert hub._weight_files(tmp_path) == ["model-00001.safetensors", "sub/model-00002.safetensors"]


def test_shard_names_are_checked_without_touching_the_files(tmp_path):
    root = tmp_path / "m"
    root.mkdir()
    assert validate.weight_path(root, "model-00001.safetensors") == root / "model-00001.safetensors"
    for bad in ("../x.safetensors", "/abs.safetensors", "a/../../x", "", "w*.safetensors"):
        with pytest.raises(validate.BadCheckpoint) as e:
            validate.weight_path(root, bad)
        assert e.value.exit_code == 2 and "\n" not in str(e.value)


# ---- memory -------------------------------------------------------------------------------------

def _float32_bytes(tensors) -> int:
    return sum(int(np.prod(t.shape)) * 4 for t in tensors)


def test_memory_refusal_names_both_numbers(good_gguf, monkeypatch, dequantized):
    need = _float32_bytes(gguf_tensors().values())
    monkeypatch.setattr(machine, "host_available_memory", lambda: 100_000)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(good_gguf), progress=False)
    msg = str(e.value)
    assert f"the model needs {need / 1024:.1f} KiB of memory for its weights but only 97.7 KiB is available" in msg
    assert e.value.exit_code == 1 and "\n" not in msg
    assert sum(dequantized) == 0
    monkeypatch.setattr(machine, "host_available_memory", lambda: need)  # exactly enough: loads
    assert len(load_checkpoint(str(good_gguf), progress=False).weights) == len(gguf_tensors())


def test_memory_need_follows_quant_mode_and_dtype(tmp_path, monkeypatch):
    """Q4_0 blocks kept quantized (quant: gguf) are 1 byte per weight plus 8 per 32-weight group;
    dequantized they are 4 bytes per weight; a float64 model would need 8."""
    from gguf.quants import quantize
    t = gguf_tensors()
    q = {k: (quantize(v, QT.Q4_0), QT.Q4_0, None) if v.ndim == 2 else v for k, v in t.items()}
    path = write_gguf(tmp_path / "q4.gguf", q)
    lean = sum(v.size + 8 * v.size // 32 if v.ndim == 2 else 4 * v.size for v in t.values())
    full = _float32_bytes(t.values())
    avail = {"n": lean}
    monkeypatch.setattr(machine, "host_available_memory", lambda: avail["n"])
    assert load_checkpoint(str(path), progress=False, quant="gguf").weights
    with pytest.raises(CheckpointError, match=rf"needs {full / 1024:.1f} KiB .* \(with --quant gguf it needs "
                                              rf"{lean / 1024:.1f} KiB\)"):
        load_checkpoint(str(path), progress=False)
    avail["n"] = lean - 1
    with pytest.raises(CheckpointError, match="for its weights but only"):
        load_checkpoint(str(path), progress=False, quant="gguf")
    avail["n"] = full
    assert load_checkpoint(str(path), progress=False).weights
    with pytest.raises(CheckpointError, match=rf"needs {2 * full / 1024:.1f} KiB"):
        load_checkpoint(str(path), progress=False, dtype=torch.float64)


def test_memory_refusal_for_a_model_directory_via_the_cli(llama_dir, monkeypatch, capsys, tmp_path, st_reads):
    from safetensors.torch import load_file
    need = sum(t.numel() * t.element_size() for t in load_file(str(Path(llama_dir) / "model.safetensors")).values())
    monkeypatch.setattr(machine, "host_available_memory", lambda: 100 << 10)
    code, out, err = cli_load(capsys, tmp_path, llama_dir)
    assert_one_sentence(code, out, err, f"needs {need / 1024:.1f} KiB of memory for its weights but only "
                                        f"100.0 KiB is available", want_code=1)
    assert st_reads == []


def test_two_sizes_never_print_the_same_number():
    assert validate.two_sizes(int(7.9 * 2**30), int(3.1 * 2**30)) == ("7.9 GiB", "3.1 GiB")
    a, b = validate.two_sizes(2**30 + 2**20, 2**30)
    assert a != b and a.endswith("GiB")
    assert validate.two_sizes(500, 20) == ("500 bytes", "20 bytes")


def test_available_memory_reads_memavailable(tmp_path, monkeypatch):
    psutil = pytest.importorskip("psutil")
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo")
    ours, theirs = machine.host_available_memory(), psutil.virtual_memory().available
    assert ours is not None and abs(ours - theirs) < max(256 << 20, theirs // 10)
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:     2048 kB\n")
    assert machine.host_available_memory(str(fake)) == 2048 * 1024


def test_unknown_available_memory_skips_the_check(tmp_path, monkeypatch, good_gguf):
    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:  1000 kB\n")  # an old kernel: no MemAvailable

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(machine.os, "sysconf", no_sysconf)
    assert machine.host_available_memory(str(fake)) is None
    assert machine.host_available_memory(str(tmp_path / "absent")) is None
    monkeypatch.setattr(machine, "host_available_memory", lambda: None)
    validate.check_memory(1 << 60, "x")  # unknown: no refusal
    assert load_checkpoint(str(good_gguf), progress=False).weights
