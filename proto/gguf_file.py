"""A small GGUF reader: metadata, tensor index and dequantized tensors.

gguf's own GGUFReader builds an object per array element, which takes
seconds on a tokenizer's 100k strings; this reads the header in one pass and
leaves tensor bytes memory-mapped until asked for. Dequantization is gguf's.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from shoal.proto.utils import cdiv

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9


@dataclass(slots=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF lists dims innermost first)
    ggml_type: int
    offset: int  # absolute, in the file


class GGUFFile:
    def __init__(self, path: str):
        self.path = path
        self._buf = np.memmap(path, dtype=np.uint8, mode="r")
        self._mv = memoryview(self._buf)  # type: ignore[arg-type]  # numpy declares __buffer__ from 3.12
        self._pos = 0
        if bytes(self._mv[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        self._pos = 4
        version = self._read("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old")
        n_tensors, n_kv = self._read("<Q"), self._read("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._read_str()
            self.metadata[key] = self._read_value(self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._read_str()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            infos.append((name, tuple(reversed(dims)), self._read("<I"), self._read("<Q")))
        align = self.metadata.get("general.alignment", 32)
        data_start = cdiv(self._pos, align) * align
        self.tensors = {n: GGUFTensor(n, s, t, data_start + o) for n, s, t, o in infos}

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._mv, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_str(self) -> str:
        n = self._read("<Q")
        s = bytes(self._mv[self._pos : self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _read_value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._read_str()
        if vtype == _ARRAY:
            etype, count = self._read("<I"), self._read("<Q")
            if etype in _NUMPY:  # numeric arrays in one go
                arr: npt.NDArray[Any] = np.frombuffer(self._mv, dtype=_NUMPY[etype], count=count, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._read_value(etype) for _ in range(count)]
        return self._read(_SCALARS[vtype])

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32 (or its float type), dequantized."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        t = self.tensors[name]
        qtype = GGMLQuantizationType(t.ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = int(np.prod(t.shape))
        nbytes = n // block * type_size
        raw = self._buf[t.offset : t.offset + nbytes]
        if qtype == GGMLQuantizationType.F32:
            return np.asarray(raw.view(np.float32)).reshape(t.shape)
        if qtype == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(t.shape)
        if qtype == GGMLQuantizationType.BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
        rows = raw.reshape(-1, t.shape[-1] // block * type_size)
        return dequantize(rows, qtype).reshape(t.shape)

    def is_float(self, name: str) -> bool:
        from gguf import GGMLQuantizationType as T

        return self.tensors[name].ggml_type in (T.F32, T.F16, T.BF16)

    def load_blocks(self, name: str) -> np.ndarray:
        """The tensor's blocks as they are in the file: uint8 [*rows, bytes a
        row], a read-only view of the mapped file."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        t = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        row = t.shape[-1] // block * type_size
        n = int(np.prod(t.shape[:-1]))
        return self._buf[t.offset : t.offset + n * row].reshape(*t.shape[:-1], row)
