"""write_kv of the Triton backend: K/V land in their slots (cast to the cache dtype), slot -1 is
skipped, and every other slot of the cache is left untouched.  Runs on the CPU through the Triton
interpreter when there is no GPU (see conftest.py)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
pytest.importorskip("triton")

from roofline.attention.backend import write_kv_torch  # noqa: E402
from roofline.attention.selector import get_attention_backend  # noqa: E402
from roofline.attention.triton.backend import TritonAttentionBackend  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _expected(kv_cache, key, value, slots):
    exp = kv_cache.clone()
    keep = slots >= 0
    write_kv_torch(key[keep], value[keep], exp, slots[keep])
    return exp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (2, 128), (4, 64)])
def test_write_kv_slots(dtype, block_size, num_kv_heads, head_dim):
    g = torch.Generator().manual_seed(block_size * 7 + num_kv_heads * 3 + head_dim)
    num_blocks, n = 6, 13
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to(torch.int64)
    slots[[2, 7]] = -1  # padding rows: must be skipped
    # key/value as strided views of a fused buffer on the device, like a qkv split.
    fused = torch.randn(n, 3, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    key, value = fused[:, 1], fused[:, 2]
    slots = slots.to(DEVICE)
    assert not key.is_contiguous()

    exp = _expected(kv_cache, key, value, slots)
    TritonAttentionBackend().write_kv(key, value, kv_cache, slots)
    # Exact equality of the whole cache: written slots match, untouched slots unchanged.
    assert torch.equal(kv_cache, exp)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_kv_casts_to_cache_dtype(dtype):
    """fp32 key/value into a half-precision cache: converted on write (the CPU interpreter rounds
    toward zero where the GPU rounds to nearest, hence 1-ulp tolerance), other slots untouched."""
    g = torch.Generator().manual_seed(5)
    num_blocks, block_size, hk, d, n = 4, 16, 2, 64, 9
    kv_cache = torch.randn(2, num_blocks, block_size, hk, d, generator=g).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to(DEVICE)
    key = torch.randn(n, hk, d, generator=g).to(DEVICE)
    value = torch.randn(n, hk, d, generator=g).to(DEVICE)
    before = kv_cache.clone()
    TritonAttentionBackend().write_kv(key, value, kv_cache, slots)
    flat, flat_before = kv_cache.view(2, -1, hk, d), before.view(2, -1, hk, d)
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    torch.testing.assert_close(flat[0, slots].float(), key, rtol=ulp, atol=1e-6)
    torch.testing.assert_close(flat[1, slots].float(), value, rtol=ulp, atol=1e-6)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


def test_write_kv_same_dtype_contiguous_and_empty():
    backend = get_attention_backend("triton", DEVICE)
    assert isinstance(backend, TritonAttentionBackend)
    kv_cache = torch.zeros(2, 3, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    key = torch.randn(5, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    value = torch.randn(5, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([0, 17, 47, 33, 5], dtype=torch.int64, device=DEVICE)
    backend.write_kv(key, value, kv_cache, slots)
    flat = kv_cache.view(2, 48, 2, 64)
    assert torch.equal(flat[0, slots], key) and torch.equal(flat[1, slots], value)
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert (flat[:, untouched.to(DEVICE)] == 0).all()
    # No rows: nothing happens.
    before = kv_cache.clone()
    backend.write_kv(key[:0], value[:0], kv_cache, slots[:0])
    assert torch.equal(kv_cache, before)
