"""Fused Triton kernels (roofline/model_executor/layers/triton_ops.py) against the torch layers they
replace: RMSNorm (+ residual), SiluAndMul, rotate-half RoPE (full and partial rotary, strided q/k).

Without a GPU the kernels run through the Triton interpreter on CPU tensors (TRITON_INTERPRET=1 has to
be set before the kernels are defined, as in tests/attention/conftest.py).  The interpreter rounds
casts to bf16/fp16 toward zero where a GPU rounds to nearest, so half-precision results may differ
from torch by an ulp; fp32 is held to 1e-5.
"""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton_ops defines its kernels
    _mod = sys.modules.get("roofline.model_executor.layers.triton_ops")
    if _mod is not None and type(_mod._rms_norm_kernel).__name__ != "InterpretedFunction":
        importlib.reload(_mod)
pytest.importorskip("triton")

from roofline.cpu import ops as cpu_ops
from roofline.model_executor.layers import fused_ops, triton_ops  # noqa: E402
from roofline.model_executor.layers.activation import SiluAndMul  # noqa: E402
from roofline.model_executor.layers.norm import RMSNorm  # noqa: E402
from roofline.model_executor.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got, exp, dtype):
    atol, rtol = TOL[dtype]
    assert got.dtype == exp.dtype and got.shape == exp.shape, (got.dtype, exp.dtype, got.shape, exp.shape)
    torch.testing.assert_close(got.float(), exp.float(), atol=atol, rtol=rtol)


# ---- RMSNorm --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 64, 100])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_rms_norm(dtype, hidden, n):
    g = torch.Generator().manual_seed(hidden * 131 + n)
    norm = RMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(hidden, generator=g))
    norm = norm.to(dtype).to(DEVICE)
    x = (2.0 * torch.randn(n, hidden, generator=g)).to(dtype).to(DEVICE)
    res = torch.randn(n, hidden, generator=g).to(dtype).to(DEVICE)
    x_before, res_before = x.clone(), res.clone()

    _close(triton_ops.rms_norm(x, norm.weight, norm.eps), norm(x), dtype)
    out, new_res = triton_ops.rms_norm(x, norm.weight, norm.eps, res)
    exp_out, exp_res = norm(x, res)
    _close(out, exp_out, dtype)
    # the residual sum is one rounding of x + res in the input dtype: exact in fp32, <= 1 ulp otherwise
    if dtype == torch.float32:
        assert torch.equal(new_res, exp_res)
    else:
        _close(new_res, exp_res, dtype)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_per_head_on_strided_view(dtype):
    """Qwen3's q/k norm: [N, H, D] views of the fused qkv output (row stride != H * D), no copy."""
    g = torch.Generator().manual_seed(3)
    n, h, hk, d = 7, 4, 2, 64
    qkv = torch.randn(n, (h + 2 * hk) * d, generator=g).to(dtype).to(DEVICE)
    q = qkv[:, : h * d].view(n, h, d)
    k = qkv[:, h * d : (h + hk) * d].view(n, hk, d)
    assert not q.is_contiguous()
    norm = RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
    norm = norm.to(dtype).to(DEVICE)
    _close(triton_ops.rms_norm(q, norm.weight, norm.eps), norm(q), dtype)
    _close(triton_ops.rms_norm(k, norm.weight, norm.eps), norm(k), dtype)


def test_rms_norm_mixed_dtypes_follow_torch_promotion():
    """fp32 weight on bf16 activations: torch gives fp32 output (weight * bf16 value); so do we."""
    g = torch.Generator().manual_seed(4)
    hidden = 100
    norm = RMSNorm(hidden)  # fp32 weight
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
    norm = norm.to(DEVICE)
    x = torch.randn(7, hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    res = torch.randn(7, hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    out, new_res = triton_ops.rms_norm(x, norm.weight, norm.eps, res)
    exp_out, exp_res = norm(x, res)
    assert out.dtype == exp_out.dtype == torch.float32 and new_res.dtype == torch.bfloat16
    _close(out, exp_out, torch.bfloat16)
    _close(new_res, exp_res, torch.bfloat16)


# ---- SiLU-and-mul ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [576, 64, 100])
@pytest.mark.parametrize("n", [1, 7, 33])
def test_silu_and_mul(dtype, d, n):
    g = torch.Generator().manual_seed(d * 7 + n)
    x = (3.0 * torch.randn(n, 2 * d, generator=g)).to(dtype).to(DEVICE)
    _close(triton_ops.silu_and_mul(x), SiluAndMul()(x), dtype)


def test_silu_and_mul_3d_and_empty():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 2 * 100, generator=g).to(DEVICE)
    _close(triton_ops.silu_and_mul(x), SiluAndMul()(x), torch.float32)
    empty = torch.empty(0, 2 * 64, device=DEVICE)
    assert triton_ops.silu_and_mul(empty).shape == (0, 64)


# ---- RoPE -----------------------------------------------------------------------------------

ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _rope_case(n, h, hk, d, rot, dtype, seed, strided):
    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(d, 512, ROPE, rotary_dim=rot).to(DEVICE)
    positions = torch.randint(0, 512, (n,), generator=g).to(DEVICE)
    if strided:  # q and k as views of one fused qkv tensor, like LlamaAttention.forward makes them
        qkv = torch.randn(n, (h + 2 * hk) * d, generator=g).to(dtype).to(DEVICE)
        q = qkv[:, : h * d].view(n, h, d)
        k = qkv[:, h * d : (h + hk) * d].view(n, hk, d)
    else:
        q = torch.randn(n, h, d, generator=g).to(dtype).to(DEVICE)
        k = torch.randn(n, hk, d, generator=g).to(dtype).to(DEVICE)
    return rope, positions, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 33])
@pytest.mark.parametrize("h,hk,d,rot", [(4, 2, 64, 64), (3, 1, 100, 100), (9, 3, 64, 32), (4, 4, 96, 48)])
def test_rope_in_place(dtype, n, h, hk, d, rot):
    rope, positions, q, k = _rope_case(n, h, hk, d, rot, dtype, seed=n * 17 + d + rot, strided=n != 7)
    cos, sin = rope.cos_sin(positions, dtype)  # [N, 1, rot]
    exp_q, exp_k = rope(positions, q, k, (cos, sin))
    q_in, k_in = q.clone(), k.clone()
    got_q, got_k = triton_ops.rotary_embedding_(q, k, cos, sin)
    assert got_q is q and got_k is k  # rotated in place
    _close(q, exp_q, dtype)
    _close(k, exp_k, dtype)
    if rot < d:  # the pass-through dims are never touched
        assert torch.equal(q[..., rot:], q_in[..., rot:]) and torch.equal(k[..., rot:], k_in[..., rot:])


def test_rope_strided_leaves_v_alone():
    """Rotating the q/k views of a fused qkv buffer must not write the v part."""
    n, h, hk, d = 5, 4, 2, 64
    rope, positions, q, k = _rope_case(n, h, hk, d, d, torch.float32, seed=11, strided=True)
    qkv = q._base if q._base is not None else q
    v_before = qkv[:, (h + hk) * d :].clone()
    cos, sin = rope.cos_sin(positions, torch.float32)
    triton_ops.rotary_embedding_(q, k, cos, sin)
    assert torch.equal(qkv[:, (h + hk) * d :], v_before)


# ---- the switch -----------------------------------------------------------------------------


def test_switch_never_sends_cpu_tensors_to_triton():
    """CPU tensors follow the native-CPU-kernel switch only, never the Triton one."""
    x = torch.randn(3, 8)
    with cpu_ops.forced(False):
        assert not fused_ops.active(x)
        with fused_ops.forced(True):
            assert fused_ops.enabled() and not fused_ops.active(x)
    with fused_ops.forced(False):
        assert not fused_ops.enabled()


def test_llama_forward_with_fused_layers_matches_torch(monkeypatch):
    """The layer hooks proposed for norm.py / activation.py / rotary.py, applied here by patching the
    forwards (without the is_cuda test, so they run on CPU through the interpreter): a tiny Llama
    forward gives the torch result."""
    from roofline.attention.backend import AttentionMetadata
    from roofline.attention.torch_backend import TorchAttentionBackend
    from roofline.model_executor.models.llama import Qwen3ForCausalLM
    from tests.reference.hf_models import tiny_config

    cfg = tiny_config("qwen3", hidden_size=64, intermediate_size=96, partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg, TorchAttentionBackend()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    model.to(DEVICE)

    n_tok, bs = 7, 16
    ids = torch.randint(0, cfg.vocab_size, (n_tok,), device=DEVICE)
    pos = torch.arange(n_tok, device=DEVICE)

    def run():
        caches = [torch.zeros(2, 2, bs, 2, 16, device=DEVICE) for _ in model.model.layers]
        meta = AttentionMetadata(
            num_tokens=n_tok, num_reqs=1, num_decodes=0,
            query_start_loc=torch.tensor([0, n_tok], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([n_tok], dtype=torch.int32, device=DEVICE),
            block_tables=torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE),
            slot_mapping=torch.arange(n_tok, device=DEVICE),
            max_query_len=n_tok, max_seq_len=n_tok, query_start_loc_cpu=[0, n_tok], seq_lens_cpu=[n_tok],
        )  # fmt: skip
        # the torch layers (no built-in fused path on either device), or the Triton patches below
        with torch.inference_mode(), cpu_ops.forced(False), fused_ops.forced(False):
            return model.compute_logits(model(ids, pos, caches, meta))

    expected = run()

    def norm_forward(self, x, residual=None):
        return triton_ops.rms_norm(x, self.weight, self.eps, residual)

    def act_forward(self, x):
        return triton_ops.silu_and_mul(x)

    orig_rope = RotaryEmbedding.forward

    def rope_forward(self, positions, q, k, cos_sin=None):
        cos, sin = cos_sin if cos_sin is not None else self.cos_sin(positions, q.dtype)
        if q.dtype == k.dtype == cos.dtype and q.stride(-1) == 1 and k.stride(-1) == 1:
            return triton_ops.rotary_embedding_(q, k, cos, sin)
        return orig_rope(self, positions, q, k, (cos, sin))

    monkeypatch.setattr(RMSNorm, "forward", norm_forward)
    monkeypatch.setattr(SiluAndMul, "forward", act_forward)
    monkeypatch.setattr(RotaryEmbedding, "forward", rope_forward)
    got = run()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
