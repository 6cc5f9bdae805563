"""A fast GGUF header reader with the subset of ``gguf.GGUFReader``'s interface the loader uses.

Why: ``gguf.GGUFReader`` builds a numpy memmap view for every part of every metadata field; the
default model's 49k-token vocabulary and 49k merges make that about 100k fields' worth of views,
measured at 2-7 s of a 3-10 s start-up. Read straight from the header bytes, the same metadata
takes a tenth of a second. Tensor data stays a read-only memmap of the file, shaped exactly as
``GGUFReader`` shapes it, so ``gguf.quants.dequantize`` and everything else read it unchanged.

Invariants: ``fields[key].contents()`` returns what ``GGUFReader`` returns (str, int, float, bool
or a list of them); ``tensors[i]`` has ``name``, ``shape`` (innermost first, as GGUF stores it),
``tensor_type`` (a ``GGMLQuantizationType``) and ``data``. A short or malformed file raises
``ValueError`` (the loader turns it into one sentence).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass
class Field:
    value: object

    def contents(self):
        return self.value


@dataclass
class Tensor:
    name: str
    shape: list[int]
    tensor_type: GGMLQuantizationType
    data: np.ndarray


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        s = bytes(self.buf[self.pos:self.pos + n])
        if len(s) != n:
            raise ValueError("the file ends inside a string")
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("<I"), self.unpack("<Q")
            if etype == _STRING:
                return [self.string() for _ in range(n)]
            if etype not in _NP:
                raise ValueError(f"unknown array element type {etype}")
            arr = np.frombuffer(self.buf, dtype=_NP[etype], count=n, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.unpack(_SCALARS[vtype])


class GGUFFile:
    """``GGUFFile(path).fields`` and ``.tensors``, like ``gguf.GGUFReader``."""

    def __init__(self, path: str):
        mm = np.memmap(path, mode="r")
        c = _Cursor(mm)
        try:
            if bytes(mm[:4]) != b"GGUF":
                raise ValueError("not a GGUF file")
            c.pos = 4
            version, n_tensors, n_kv = c.unpack("<I"), c.unpack("<Q"), c.unpack("<Q")
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported")
            self.fields = {"GGUF.version": Field(version), "GGUF.tensor_count": Field(n_tensors),
                           "GGUF.kv_count": Field(n_kv)}
            for _ in range(n_kv):
                key = c.string()
                self.fields[key] = Field(c.value(c.unpack("<I")))
            infos = [self._tensor_info(c) for _ in range(n_tensors)]
        except struct.error as e:
            raise ValueError(f"the GGUF header is truncated ({e})") from e
        align = int(self.fields.get("general.alignment", Field(32)).value)
        start = -(-c.pos // align) * align
        self.tensors = [self._tensor(mm, start, *info) for info in infos]

    @staticmethod
    def _tensor_info(c: _Cursor):
        name = c.string()
        dims = [c.unpack("<Q") for _ in range(c.unpack("<I"))]
        return name, dims, GGMLQuantizationType(c.unpack("<I")), c.unpack("<Q")

    @staticmethod
    def _tensor(mm, start: int, name: str, dims: list[int], kind, offset: int) -> Tensor:
        n = int(np.prod(dims)) if dims else 1
        rows = list(reversed(dims))
        if kind in _PLAIN:
            dtype, count = _PLAIN[kind], n
        else:  # blocks of raw bytes, the last axis in bytes as GGUFReader gives them
            block, size = GGML_QUANT_SIZES[kind]
            dtype, count = np.uint8, n // block * size
            rows[-1] = rows[-1] // block * size
        begin = start + offset
        if begin + count * np.dtype(dtype).itemsize > mm.shape[0]:
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = np.frombuffer(mm, dtype=dtype, count=count, offset=begin).reshape(rows)
        return Tensor(name, dims, kind, data)
