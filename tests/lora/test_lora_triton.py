"""The Triton shrink/expand kernels (lora/triton_ops.py) against the torch reference (lora/ops.py), through
Triton's interpreter where there is no GPU: fp32, bf16 and fp16, slices on and off, groups with gaps (base
rows untouched), a slot's stale columns past its adapter's rank masked."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import interpret_without_gpu  # noqa: E402

interpret_without_gpu("roofline.lora.triton_ops", "_shrink_kernel")  # (conftest did, before triton's import)
pytest.importorskip("triton")

from roofline.lora import ops, triton_ops  # noqa: E402
from roofline.lora.layers import LoRALayer, LoRAStepState  # noqa: E402
from roofline.lora.mapping import Slice, Target  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def layer(in_features, sizes, dtype, max_rank=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    target = Target("t", None, False, in_features, in_features, sum(sizes),
                    [Slice(i, n, off, n) for i, (off, n) in enumerate(zip(offs, sizes))])
    lay = LoRALayer(target, LoRAStepState(3), 3, max_rank, dtype, DEVICE)
    for slot, r in enumerate((16, 3, 8)):  # slot 1 first holds a rank-16 adapter: stale columns past rank 3
        for rank in ((16, r) if slot == 1 else (r,)):
            on = [s == 0 or (slot + s) % 2 == 1 for s in range(len(sizes))]
            lay.load_slot(slot, ((torch.randn(len(sizes), rank, in_features, generator=g) * 0.3).to(dtype),
                                 (torch.randn(sum(sizes), rank, generator=g) * 0.3).to(dtype), on))
        lay.state.ranks[slot] = r
    return lay


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_features,sizes", [(64, [64, 32, 32]), (100, [130]), (48, [24, 90])])
def test_matches_torch(dtype, in_features, sizes):
    lay = layer(in_features, sizes, dtype)
    g = torch.Generator().manual_seed(1)
    rows = 45
    x = torch.randn(rows, in_features, generator=g).to(dtype).to(DEVICE)
    y0 = torch.randn(rows, sum(sizes), generator=g).to(dtype).to(DEVICE)
    groups = [(1, 3, 0, 5), (0, 16, 5, 23), (2, 8, 26, 45)]  # rows 23-25: the base model's
    want = y0.float().clone()  # (float() of an fp32 tensor is the tensor itself)
    ops.add_lora_torch(x.float(), want, _as_fp32(lay), groups)  # the reference in fp32
    got = y0.clone()
    triton_ops.add_lora(x, got, lay, groups)
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want, atol=tol * max(1.0, want.abs().max().item()), rtol=tol)
    assert torch.equal(got[23:26], y0[23:26])


def _as_fp32(lay):
    """The same slots in fp32 (the reference in full precision)."""
    twin = LoRALayer(lay.target, lay.state, lay.a.shape[0], lay.a.shape[2], torch.float32, lay.a.device)
    twin.a.copy_(lay.a.float())
    twin.bt.copy_(lay.bt.float())
    twin.slice_on = [list(on) for on in lay.slice_on]
    twin.slice_on_t.copy_(lay.slice_on_t)
    return twin


def test_routes_cuda_tensors_to_triton(monkeypatch):
    lay = layer(32, [32], torch.float32)
    calls = []
    monkeypatch.setattr(triton_ops, "add_lora", lambda *a: calls.append("triton"))
    x = torch.zeros(2, 32)
    monkeypatch.setattr(ops, "_on_cuda", lambda t: True)
    monkeypatch.setattr(ops, "native_takes", lambda x, y: False)
    ops.add_lora(x, torch.zeros(2, 32), lay, [(0, 16, 0, 2)])
    assert calls == ["triton"]


def test_engine_with_the_triton_kernels_matches_peft(lora_family, monkeypatch):
    """The whole engine with every LoRA delta through the (interpreted) Triton kernels: PEFT's tokens."""
    from roofline import SamplingParams
    from tests.lora.conftest import MAX_TOKENS
    from tests.model_executor.family_parity import generate, tokens

    fam = lora_family("llama")
    calls = []
    real = triton_ops.add_lora
    monkeypatch.setattr(ops, "native_takes", lambda x, y: False)
    monkeypatch.setattr(ops, "_on_cuda", lambda t: True)
    monkeypatch.setattr(triton_ops, "add_lora", lambda *a: calls.append(1) or real(*a))
    outs, _ = generate(fam.path, fam.prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       lora_request=fam.lora_requests(), num_kv_blocks=128, enable_lora=True, max_loras=2,
                       max_lora_rank=8, cpu_layer_stack=False)  # the modules' layers, which call ops.add_lora
    assert tokens(outs) == fam.expected
    assert calls
