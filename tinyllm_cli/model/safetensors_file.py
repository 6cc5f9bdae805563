"""A safetensors file's header, read and checked without touching its tensor data.

Format: 8 bytes little-endian header length N, N bytes of JSON mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte after the
header), optionally ``"__metadata__"``, then the data.

Invariants: ``read_header`` returns one ``StTensor`` per tensor only if every one has a known
dtype, a shape of non-negative integers whose element count times the dtype's size is exactly
its byte range, and a range inside the file that shares no byte with another tensor's; else a
``ValueError`` whose text is a clause naming what is wrong (the loader wraps it in one sentence).
What it reads is bounded by the file's size, never by what the header claims.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from .validate import check_ranges

# safetensors' dtype names -> (bytes per element, torch's name for it, floating point?)
DTYPES = {
    "F64": (8, "float64", True), "F32": (4, "float32", True), "F16": (2, "float16", True),
    "BF16": (2, "bfloat16", True), "F8_E4M3": (1, "float8_e4m3fn", True), "F8_E5M2": (1, "float8_e5m2", True),
    "I64": (8, "int64", False), "I32": (4, "int32", False), "I16": (2, "int16", False),
    "I8": (1, "int8", False), "U64": (8, "uint64", False), "U32": (4, "uint32", False),
    "U16": (2, "uint16", False), "U8": (1, "uint8", False), "BOOL": (1, "bool", False),
}
MAX_HEADER = 100_000_000  # the safetensors library's own limit


@dataclass(frozen=True)
class StTensor:
    name: str
    dtype: str  # safetensors' spelling, a key of DTYPES
    shape: tuple[int, ...]
    begin: int  # absolute byte range in the file
    end: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> list[StTensor]:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"the file has {len(head)} bytes, fewer than the 8 of its header length")
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER or 8 + n > size:
            raise ValueError(f"its header claims {n} bytes but the file has {size - 8} after the length field")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"its header is not valid JSON ({e.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    start = 8 + n
    tensors = [_tensor(name, info, start) for name, info in header.items() if name != "__metadata__"]
    check_ranges([(t.name, t.begin, t.end) for t in tensors], start, size)
    return tensors


def _tensor(name: str, info, start: int) -> StTensor:
    if not isinstance(info, dict):
        raise ValueError(f"the header entry of tensor {name} is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise ValueError(f"tensor {name} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_count(x) for x in shape):
        raise ValueError(f"tensor {name} has shape {shape!r}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_count(x) for x in offsets):
        raise ValueError(f"tensor {name} has data_offsets {offsets!r}, not two non-negative integers")
    t = StTensor(name, dtype, tuple(shape), start + offsets[0], start + offsets[1])
    if t.end - t.begin != t.numel * t.itemsize:
        raise ValueError(f"tensor {name} has {t.end - t.begin} data bytes but its shape {list(shape)} of "
                         f"{dtype} needs {t.numel * t.itemsize}")
    return t


def _count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0
