"""The loader's GGUF tensor table (loader/gguf_file.py) against gguf-py's GGUFReader: the same tensors, types,
shapes, dtypes and bytes, for the default model's file and for a file with every kind of metadata value, a
non-default alignment and typed, half and block-quantized tensors -- without parsing the metadata values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from roofline.model_executor.loader.gguf_file import GgufTensors
from roofline.model_executor.loader.source import default_model_file


def _same_as_reader(path: str) -> GgufTensors:
    ours, theirs = GgufTensors(path), gguf.GGUFReader(path)
    assert ours.architecture == theirs.fields["general.architecture"].contents()
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name
    return ours


def test_default_model_file():
    ours = _same_as_reader(default_model_file())
    assert ours.architecture == "llama" and len(ours.tensors) > 100


def test_every_value_kind_alignment_and_tensor_type(tmp_path):
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_string("general.name", "tiny")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_int64("x.int64", -5)
    w.add_float64("x.f64", 0.5)
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" * (i % 7) for i in range(3000)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(3000)])
    w.add_array("tokenizer.ggml.token_type", [1, 2, 3] * 100)
    g = np.random.default_rng(0)
    w.add_tensor("a.f32", g.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("b.f16", g.standard_normal((4, 64)).astype(np.float16))
    w.add_tensor("c.i32", np.arange(7, dtype=np.int32))
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.BF16):
        x = g.standard_normal((2, 256)).astype(np.float32)
        w.add_tensor(f"d.{qtype.name}", gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours = _same_as_reader(path)
    assert ours.metadata["general.alignment"] == 64
    assert [t.tensor_type.name for t in ours.tensors] == ["F32", "F16", "I32", "Q8_0", "Q4_0", "BF16"]


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GgufTensors(str(bad))
