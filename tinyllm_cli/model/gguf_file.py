"""A fast GGUF header reader with the subset of ``gguf.GGUFReader``'s interface the loader uses.

Why: ``gguf.GGUFReader`` builds a numpy memmap view for every part of every metadata field; the
default model's 49k-token vocabulary and 49k merges make that about 100k fields' worth of views,
measured at 2-7 s of a 3-10 s start-up. Read straight from the header bytes, the same metadata
takes a tenth of a second. Tensor data stays a read-only memmap of the file, shaped exactly as
``GGUFReader`` shapes it, so ``gguf.quants.dequantize`` and everything else read it unchanged.

Invariants: ``fields[key].contents()`` returns what ``GGUFReader`` returns (str, int, float, bool
or a list of them); ``tensors[i]`` has ``name``, ``shape`` (innermost first, as GGUF stores it),
``tensor_type`` (a ``GGMLQuantizationType``), ``data`` and ``offset`` (its first byte in the file).
Once constructed, every tensor's bytes lie inside the file, at an aligned offset, and no two
tensors share a byte or a name (``validate.check_ranges``): the header cannot make the loader
read one region of a small file over and over. Sizes are computed with Python integers, so
no dimension product overflows. A short or malformed file raises ``ValueError`` whose text is a
clause naming what is wrong (the loader wraps it in one sentence); nothing is allocated in
proportion to what the header claims, only to what the file holds.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from .validate import check_ranges

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
       7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS: ggml tensors have at most four dimensions
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
    offset: int = 0  # the tensor's first byte in the file


class _Cursor:
    def __init__(self, buf):
        # A memoryview, not the memmap: slicing a memmap builds an ndarray per string, which for
        # the default model's ~98k vocabulary and merge strings cost about half a second.
        self.buf, self.pos = memoryview(buf), 0

    def unpack(self, fmt: str):
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, n: int) -> list[str]:
        """``n`` strings in a row (one loop for the vocabulary's tens of thousands)."""
        buf, pos, size, out = self.buf, self.pos, len(self.buf), []
        length = struct.Struct("<Q").unpack_from
        for _ in range(n):
            (k,) = length(buf, pos)
            pos += 8
            if pos + k > size:
                raise ValueError("the file ends inside a string")
            out.append(str(buf[pos:pos + k], "utf-8", "replace"))
            pos += k
        self.pos = pos
        return out

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.unpack("<I"), self.unpack("<Q")
            if etype == _STRING:
                return self.strings(n)
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
            raise ValueError("the header ends before its last field") from e
        align = self.fields.get("general.alignment", Field(32)).value
        if isinstance(align, bool) or not isinstance(align, int) or align <= 0:
            raise ValueError(f"its general.alignment is {align!r}, not a positive integer")
        start = -(-c.pos // align) * align
        self.tensors = [self._tensor(mm, start, align, *info) for info in infos]
        self._check_layout(start, mm.shape[0])

    def _check_layout(self, start: int, size: int) -> None:
        """Every tensor inside the data section, none sharing a byte or a name with another."""
        names = set()
        for t in self.tensors:
            if t.name in names:
                raise ValueError(f"tensor {t.name} is listed twice")
            names.add(t.name)
        check_ranges([(t.name, t.offset, t.offset + t.data.nbytes) for t in self.tensors], start, size)

    @staticmethod
    def _tensor_info(c: _Cursor):
        name = c.string()
        n_dims = c.unpack("<I")
        if n_dims > _MAX_DIMS:  # also keeps a garbage count from looping over the rest of the file
            raise ValueError(f"tensor {name} has {n_dims} dimensions (ggml allows at most {_MAX_DIMS})")
        dims = [c.unpack("<Q") for _ in range(n_dims)]
        code = c.unpack("<I")
        try:
            kind = GGMLQuantizationType(code)
        except ValueError:
            raise ValueError(f"tensor {name} has unknown type code {code}") from None
        return name, dims, kind, c.unpack("<Q")

    @staticmethod
    def _tensor(mm, start: int, align: int, name: str, dims: list[int], kind, offset: int) -> Tensor:
        n = math.prod(dims)  # Python ints: a header's 2**40 x 2**40 cannot wrap to a small number
        rows = list(reversed(dims))
        if kind in _PLAIN:
            dtype, count = _PLAIN[kind], n
        elif kind in GGML_QUANT_SIZES:  # blocks of raw bytes, the last axis in bytes as GGUFReader gives them
            block, size = GGML_QUANT_SIZES[kind]
            if not dims or dims[0] % block:
                raise ValueError(f"tensor {name} of type {kind.name} has a row of {dims[0] if dims else 0} "
                                 f"values, not a whole number of {block}-value blocks")
            dtype, count = np.uint8, n // block * size
            rows[-1] = rows[-1] // block * size
        else:
            raise ValueError(f"tensor {name} has type {kind.name}, whose block size is unknown")
        if offset % align:
            raise ValueError(f"tensor {name} starts at offset {offset}, not a multiple of the alignment {align}")
        begin = start + offset
        end = begin + count * np.dtype(dtype).itemsize
        check_ranges([(name, begin, end)], start, mm.shape[0])  # before frombuffer sees the numbers
        data = np.frombuffer(mm, dtype=dtype, count=count, offset=begin).reshape(rows)
        return Tensor(name, dims, kind, data, begin)
