"""Linear layers keeping GGUF blocks (LinearBase.load_weight): shards land at their rows, a layer whose
shards mix formats (or take a dense one) turns back into fp32 with every shard's values, and forward
computes F.linear over the dequantized weight either way."""

import pytest
import torch
import torch.nn.functional as F

from roofline.cpu import ops as cpu_ops
from roofline.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tests.reference.quantized import random_blocks

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels unavailable (no C compiler)")


def _reference(x, w):
    return F.linear(x.double(), w.double()).float()


def test_fused_qkv_keeps_blocks_at_each_shards_rows():
    layer = QKVParallelLinear(64, 16, num_heads=4, num_kv_heads=2)  # q 64 rows, k 32, v 32
    shards = {"q": random_blocks(3, 64, 64, seed=1), "k": random_blocks(3, 32, 64, seed=2),
              "v": random_blocks(3, 32, 64, seed=3)}
    for shard, blocks in shards.items():
        layer.load_weight(blocks, shard)
    assert layer.quant is not None and layer.quant.format == "Q4_1" and layer.weight.device.type == "meta"
    want = torch.cat([shards[s].dequantize() for s in ("q", "k", "v")])
    assert torch.equal(layer.quant.dequantize(), want)
    x = torch.randn(5, 64)
    torch.testing.assert_close(layer(x), _reference(x, want), atol=5e-4, rtol=1e-4)
    assert layer.weight_bytes() == 128 * 2 * 20


@pytest.mark.parametrize("second", ["Q6_K-like other format", "dense"])
def test_mixed_shards_turn_the_layer_back_into_fp32(second):
    layer = MergedColumnParallelLinear(256, [32, 32])
    gate = random_blocks(12, 32, 256, seed=4)  # Q4_K
    up = random_blocks(14, 32, 256, seed=5) if second != "dense" else torch.randn(32, 256)
    layer.load_weight(gate, 0)
    assert layer.quant is not None
    layer.load_weight(up, 1)
    assert layer.quant is None and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32
    want = torch.cat([gate.dequantize(), up if second == "dense" else up.dequantize()])
    assert torch.equal(layer.weight, want)
    layer.load_weight(random_blocks(12, 32, 256, seed=6), 0)  # stays fp32 once a shard went dense
    assert layer.quant is None


def test_a_dense_layer_loads_as_before():
    layer = RowParallelLinear(32, 16)
    w = torch.randn(16, 32)
    layer.load_weight(w)
    assert layer.quant is None and torch.equal(layer.weight, w)
