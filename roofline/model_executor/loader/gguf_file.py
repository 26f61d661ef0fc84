"""A GGUF file's tensors without reading its metadata values: the loader's fast path.

gguf-py's GGUFReader turns every metadata value into numpy views, the tokenizer's ~49k vocabulary strings
included (~2.5 s of the default model's start-up); the weights need only the tensor table.  `GgufTensors` walks
the header, skips the metadata values by their lengths (reading only `general.architecture` and
`general.alignment`), reads the tensor infos and maps each tensor's bytes as GGUFReader does (same numpy
dtype and shape: F16/F32/F64/I* typed, quantized types as rows of bytes), so `gguf.quants.dequantize` and the
block kernels take them unchanged.  The config and tokenizer still come from GGUFReader, once per file
(source.gguf_metadata_dir caches them).  Format: little-endian GGUF v2/v3.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# value type -> struct size of a scalar (8: string, 9: array)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclass
class GgufTensor:
    name: str
    shape: np.ndarray  # ggml's order: the fastest dimension first (as GGUFReader's `shape`)
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # a view of the mapped file


class GgufTensors:
    def __init__(self, path: str) -> None:
        import gguf

        self.path = path
        buf = np.memmap(path, mode="r")
        mv = memoryview(buf)
        if bytes(mv[:4]) != MAGIC:
            raise ValueError(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mv, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        offs = 4 + 4 + 16
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, offs = _string(mv, offs)
            (vtype,) = struct.unpack_from("<I", mv, offs)
            offs += 4
            if key in ("general.architecture", "general.alignment"):
                self.metadata[key], offs = _value(mv, offs, vtype)
            else:
                offs = _skip(mv, offs, vtype)
        infos = []
        for _ in range(n_tensors):
            name, offs = _string(mv, offs)
            (n_dims,) = struct.unpack_from("<I", mv, offs)
            dims = np.array(struct.unpack_from(f"<{n_dims}Q", mv, offs + 4), dtype=np.uint64)
            offs += 4 + 8 * n_dims
            raw_type, data_off = struct.unpack_from("<IQ", mv, offs)
            offs += 12
            infos.append((name, dims, raw_type, data_off))
        align = int(self.metadata.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"{path}: invalid general.alignment {align}")
        start = -(-offs // align) * align
        self.tensors: list[GgufTensor] = []
        seen = set()
        for name, dims, raw_type, data_off in infos:
            if name in seen:
                raise ValueError(f"{path}: duplicated tensor {name!r}")
            seen.add(name)
            qtype = gguf.GGMLQuantizationType(raw_type)
            n_elems = int(np.prod(dims)) if len(dims) else 1
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            begin = start + data_off
            dtype = _TYPED.get(qtype.name)
            if dtype is not None:
                data = buf[begin:begin + n_elems * np.dtype(dtype).itemsize].view(dtype).reshape(np_dims)
            else:
                n_bytes = n_elems * type_size // block
                data = buf[begin:begin + n_bytes].reshape(gguf.quant_shape_to_byte_shape(np_dims, qtype))
            self.tensors.append(GgufTensor(name, dims, qtype, data))

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])


def _string(mv: memoryview, offs: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", mv, offs)
    return str(mv[offs + 8:offs + 8 + n], "utf-8"), offs + 8 + n


def _value(mv: memoryview, offs: int, vtype: int) -> tuple[Any, int]:
    if vtype == STRING:
        return _string(mv, offs)
    if vtype in _FORMAT:
        return struct.unpack_from(_FORMAT[vtype], mv, offs)[0], offs + _SCALAR[vtype]
    raise ValueError(f"GGUF value type {vtype} where a scalar or string was expected")


def _skip(mv: memoryview, offs: int, vtype: int) -> int:
    if vtype == STRING:
        (n,) = struct.unpack_from("<Q", mv, offs)
        return offs + 8 + n
    if vtype == ARRAY:
        etype, count = struct.unpack_from("<IQ", mv, offs)
        offs += 12
        if etype in _SCALAR:
            return offs + _SCALAR[etype] * count
        for _ in range(count):
            offs = _skip(mv, offs, etype)
        return offs
    if vtype in _SCALAR:
        return offs + _SCALAR[vtype]
    raise ValueError(f"GGUF value type {vtype} is unknown")
