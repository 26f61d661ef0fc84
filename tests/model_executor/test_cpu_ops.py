"""Native CPU kernels (cpu_ops) against the torch layers they replace, and the switch around them."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from roofline.attention.backend import write_kv_torch
from roofline.attention.selector import get_attention_backend
from roofline.attention.cpu_backend import CpuAttentionBackend
from roofline.cpu import ops as cpu_ops
from roofline.model_executor.layers import fused_ops
from roofline.model_executor.layers.activation import GeluTanhAndMul, SiluAndMul
from roofline.model_executor.layers.norm import RMSNorm
from roofline.model_executor.layers.rotary import RotaryEmbedding
from tests.attention.paged_batches import make_batch, run_both
from tests.reference.isa_builds import each_vector_build

HAS_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"))
pytestmark = pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine: the torch path is used")

TOL = dict(atol=1e-5, rtol=1e-5)


def test_kernels_load():
    assert cpu_ops.available()
    assert get_attention_backend("auto", "cpu").name == "cpu"


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("shape", [(1, 576), (37, 64), (5, 3, 32)])
def test_rms_norm(residual, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    res = torch.randn(*shape, generator=g) if residual else None
    norm = RMSNorm(shape[-1], eps=1e-5)
    norm.weight.data = torch.randn(shape[-1], generator=g)
    with cpu_ops.forced(False):
        expected = norm(x, res) if residual else norm(x)
    got = cpu_ops.rms_norm(x, norm.weight, 1e-5, res)
    if residual:
        torch.testing.assert_close(got[0], expected[0], **TOL)
        assert torch.equal(got[1], expected[1])  # x + residual, bit for bit
    else:
        torch.testing.assert_close(got, expected, **TOL)


def test_rms_norm_strided_rows():
    """q heads of a qkv buffer (Qwen3's q_norm): rows of a strided view."""
    qkv = torch.randn(6, 5 * 16)
    q = qkv[:, : 3 * 16].view(6, 3, 16)
    w = torch.randn(16)
    expected = w * (q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(cpu_ops.rms_norm(q, w, 1e-6), expected, **TOL)


@pytest.mark.parametrize("rows,d", [(1, 1536), (64, 96), (3, 7)])
def test_silu_and_mul(rows, d):
    x = torch.randn(rows, 2 * d)
    with cpu_ops.forced(False):
        expected = SiluAndMul()(x)
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), expected, **TOL)


@pytest.mark.parametrize("rot_factor", [1.0, 0.5])
@pytest.mark.parametrize("h,hk,d", [(9, 3, 64), (4, 4, 32)])
def test_rotary_in_place_on_qkv_views(rot_factor, h, hk, d):
    n = 11
    rope = RotaryEmbedding(d, 4096, {"rope_type": "default", "rope_theta": 10000.0}, rotary_dim=int(d * rot_factor))
    positions = torch.randint(0, 4096, (n,))
    qkv = torch.randn(n, (h + 2 * hk) * d)
    q = qkv[:, : h * d].view(n, h, d)
    k = qkv[:, h * d : (h + hk) * d].view(n, hk, d)
    v_before = qkv[:, (h + hk) * d :].clone()
    with cpu_ops.forced(False):
        eq, ek = rope(positions, q.clone(), k.clone())
    cos, sin = rope.cos_sin(positions, torch.float32)
    assert cpu_ops.can_rotary(q, k, cos)
    gq, gk = cpu_ops.rotary_(q, k, cos, sin)
    assert gq.data_ptr() == q.data_ptr()  # in place
    torch.testing.assert_close(gq, eq, **TOL)
    torch.testing.assert_close(gk, ek, **TOL)
    assert torch.equal(qkv[:, (h + hk) * d :], v_before)


def test_write_kv_matches_torch():
    n, hk, d, nb, bs = 9, 3, 16, 6, 4
    qkv = torch.randn(n, 5 * hk * d)
    k = qkv[:, 3 * hk * d : 4 * hk * d].view(n, hk, d)
    v = qkv[:, 4 * hk * d :].view(n, hk, d)
    slots = torch.randperm(nb * bs)[:n]
    a, b = torch.zeros(2, nb, bs, hk, d), torch.zeros(2, nb, bs, hk, d)
    write_kv_torch(k, v, a, slots)
    assert cpu_ops.can_write_kv(k, v, b)
    cpu_ops.write_kv(k, v, b, slots)
    assert torch.equal(a, b)


MIXED = [(20, 1), (47, 1), (5, 1), (0, 1), (33, 17), (0, 25)]  # decodes (one with no prefix), chunk, prefill


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("qkv_view", [False, True])
def test_cpu_backend_mixed_batch(block_size, num_heads, num_kv_heads, qkv_view):
    meta, q, k, v, cache, _ = make_batch(MIXED, block_size=block_size, num_heads=num_heads,
                                         num_kv_heads=num_kv_heads, head_dim=64, qkv_view=qkv_view, seed=block_size)
    got, expected = run_both(meta, q, k, v, cache, CpuAttentionBackend())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("module,native", [(SiluAndMul, cpu_ops.silu_and_mul),
                                           (GeluTanhAndMul, cpu_ops.gelu_tanh_and_mul)])
def test_gated_activations_at_extremes(module, native):
    """Large |g| stays finite (exp's clamp): g far above 0 passes through, far below gives (minus) zero."""
    x = torch.tensor([[-200.0, -88.5, -30.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 20.0, 90.0, 200.0] * 2])
    with cpu_ops.forced(False):
        expected = module()(x)
    got = native(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows,d", [(1, 1536), (64, 96), (3, 7)])
def test_gelu_tanh_and_mul(rows, d):
    """GeGLU's native pass against torch's gelu(approximate="tanh") * up, in every vector build (the lanes and
    the scalar tail: d = 7)."""
    x = torch.randn(rows, 2 * d) * 3
    with cpu_ops.forced(False):
        expected = GeluTanhAndMul()(x)
    for _ in each_vector_build():
        torch.testing.assert_close(GeluTanhAndMul()(x), expected, **TOL)
        torch.testing.assert_close(cpu_ops.gelu_tanh_and_mul(x.view(rows, 1, 2 * d)), expected.view(rows, 1, d), **TOL)


@pytest.mark.parametrize("head_dim", [16, 12])  # 12: not a multiple of the SIMD width (scalar loops)
def test_decode_large_gqa_group(head_dim):
    """80 query heads on one KV head (beyond any fixed-size per-group buffer)."""
    meta, q, k, v, cache, _ = make_batch([(50, 1), (9, 1), (130, 1), (1, 1)], block_size=16, num_heads=80,
                                         num_kv_heads=1, head_dim=head_dim)
    got, expected = run_both(meta, q, k, v, cache, CpuAttentionBackend())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (10, 5), (4, 1)])  # GQA groups of 3, 2 and 4 (tiles of 3+1 heads)
@pytest.mark.parametrize("head_dim", [48, 64, 96])  # 48: a 32-wide slice and an 8-wide tail
def test_decode_gqa_tiles_and_head_sizes(num_heads, num_kv_heads, head_dim):
    specs = [(s, 1) for s in (1, 3, 16, 37, 90)]
    meta, q, k, v, cache, _ = make_batch(specs, block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                         head_dim=head_dim, seed=head_dim)
    got, expected = run_both(meta, q, k, v, cache, CpuAttentionBackend())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def run_on_threads(threads, meta, q, k, v, cache):
    """run_both with the CPU backend on `threads` torch threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run_both(meta, q, k, v, cache, CpuAttentionBackend())
    finally:
        torch.set_num_threads(saved)


PREFILLS = [(0, 130), (70, 50), (16, 2), (0, 3), (5, 47)]  # fresh prompts, chunks over cached prefixes


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (2, 2, 32), (8, 1, 16), (4, 2, 128),
                                                              (64, 1, 16)])  # 64 heads: one position per item
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_chunks_native(block_size, num_heads, num_kv_heads, head_dim, threads, monkeypatch):
    """Prefill chunks go through cpu_ops.paged_prefill_attention, all in one call."""
    calls = []
    native = cpu_ops.paged_prefill_attention
    monkeypatch.setattr(cpu_ops, "paged_prefill_attention", lambda *a, **k: calls.append(1) or native(*a, **k))
    meta, q, k, v, cache, _ = make_batch([(9, 1)] + PREFILLS, block_size=block_size, num_heads=num_heads,
                                         num_kv_heads=num_kv_heads, head_dim=head_dim, qkv_view=True,
                                         seed=block_size + head_dim)
    got, expected = run_on_threads(threads, meta, q, k, v, cache)
    assert calls == [1]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows,heads,kv_heads,head_dim", [(2, 9, 3, 64), (6, 9, 3, 64), (8, 9, 3, 64),
                                                       (5, 4, 4, 32), (7, 8, 2, 48), (3, 14, 2, 64)])
def test_a_few_rows_attend_exactly_as_decodes(rows, heads, kv_heads, head_dim):
    """A request of up to 8 query rows (a decode verifying its drafts) attends as that many decodes:
    each row's output is, bit for bit, a decode's at that row's causal length -- so speculation leaves a
    verified token's attention what it would have been without it -- though the request's K and V are read
    once for all its rows (the rows share the blocks they all see in full; the last blocks go row by row).
    Rows that end inside one block, rows that cross a block boundary, a first row at a block boundary,
    neighbouring short requests and every GQA shape.  A longer request keeps the tiles (same values within
    rounding, not bit for bit)."""
    specs = [(40, 1), (70, rows), (27, rows), (32, 2), (3, rows), (33, 20)]
    meta, q, k, v, cache, _ = make_batch(specs, block_size=16, num_heads=heads, num_kv_heads=kv_heads,
                                         head_dim=head_dim, seed=rows)
    write_kv_torch(k, v, cache, meta.slot_mapping)
    scale = 0.125
    got = torch.empty_like(q)
    cpu_ops.paged_prefill_attention(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, got)
    qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for r in range(len(specs)):
        n = qsl[r + 1] - qsl[r]
        own = torch.tensor([lens[r] - n + i + 1 for i in range(n)], dtype=torch.int32)
        as_decodes = cpu_ops.paged_decode_attention(q[qsl[r]:qsl[r + 1]].contiguous(), cache,
                                                    meta.block_tables[r:r + 1].expand(n, -1), own, scale)
        if n <= 8:
            assert torch.equal(got[qsl[r]:qsl[r + 1]], as_decodes), r
        else:
            torch.testing.assert_close(got[qsl[r]:qsl[r + 1]], as_decodes, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("specs,heads,kv_heads", [([(70, 5)], 9, 3), ([(50, 6)], 8, 1), ([(33, 2)], 4, 2),
                                                  ([(40, 8), (17, 3)], 9, 3), ([(15, 7)], 6, 3)])
def test_a_lone_verifying_request_splits_its_rows_exactly(specs, heads, kv_heads, threads):
    """A single stream verifying its drafts has fewer (request, KV head) pairs than two a thread, so its rows
    are split into parts that read the head's K and V separately: every row is still, bit for bit, a decode
    at its own causal length, whatever part it falls in (parts of uneven sizes, a part of one row, rows
    crossing a block boundary, one KV head)."""
    meta, q, k, v, cache, _ = make_batch(specs, block_size=16, num_heads=heads, num_kv_heads=kv_heads,
                                         head_dim=64, seed=len(specs) + heads)
    write_kv_torch(k, v, cache, meta.slot_mapping)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.empty_like(q)
        cpu_ops.paged_prefill_attention(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125,
                                        got)
        qsl, lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
        for r in range(len(specs)):
            n = qsl[r + 1] - qsl[r]
            own = torch.tensor([lens[r] - n + i + 1 for i in range(n)], dtype=torch.int32)
            torch.set_num_threads(1)
            as_decodes = cpu_ops.paged_decode_attention(q[qsl[r]:qsl[r + 1]].contiguous(), cache,
                                                        meta.block_tables[r:r + 1].expand(n, -1), own, 0.125)
            assert torch.equal(got[qsl[r]:qsl[r + 1]], as_decodes), r
    finally:
        torch.set_num_threads(saved)


def test_prefill_head_size_off_the_tiles_falls_back():
    """A head size that is not a multiple of 16 keeps the SDPA path, with the same result."""
    meta, q, k, v, cache, _ = make_batch([(0, 20), (7, 9)], block_size=16, num_heads=4, num_kv_heads=2, head_dim=24)
    assert not cpu_ops.can_prefill(q, cache)
    got, expected = run_both(meta, q, k, v, cache, CpuAttentionBackend())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_prefill_never_reads_unused_blocks():
    """Blocks outside the tables and the unwritten tail of each last block are NaN: any read would poison
    the output."""
    meta, q, k, v, cache, unused = make_batch([(20, 13), (0, 50)], block_size=16, num_heads=6, num_kv_heads=2,
                                              head_dim=32, spare_blocks=4)
    cache[:, unused] = float("nan")
    for r, s in enumerate(meta.seq_lens_cpu):  # slots past each request's last token
        last = int(meta.block_tables[r, (s - 1) // 16])
        cache[:, last, s % 16 or 16:] = float("nan")
    backend = CpuAttentionBackend()
    backend.write_kv(k, v, cache, meta.slot_mapping)
    out = backend.forward(q, cache, meta, 32**-0.5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_long_contexts_many_sequences(threads):
    specs = [(s, 1) for s in (1, 300, 17, 1023, 64, 129, 2, 500)]
    meta, q, k, v, cache, _ = make_batch(specs, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, seed=3)
    got, expected = run_on_threads(threads, meta, q, k, v, cache)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decode_never_reads_unused_blocks():
    """Blocks outside the tables are filled with NaN: any read would poison the output."""
    meta, q, k, v, cache, unused = make_batch([(40, 1), (3, 1), (70, 1)], block_size=16, num_heads=4,
                                              num_kv_heads=2, head_dim=32, spare_blocks=4)
    cache[:, unused] = float("nan")
    backend = CpuAttentionBackend()
    backend.write_kv(k, v, cache, meta.slot_mapping)
    out = backend.forward(q, cache, meta, 32**-0.5)
    assert torch.isfinite(out).all()


def test_layers_take_the_kernels_only_when_on():
    x = torch.randn(4, 8)
    assert fused_ops.active(x)
    assert not fused_ops.active(x.double())  # fp32 only
    with cpu_ops.forced(False):
        assert not fused_ops.active(x)
        assert get_attention_backend("auto", "cpu").name == "torch"


def test_without_a_compiler_everything_falls_back_to_torch(tmp_path):
    """A fresh process with no usable compiler and an empty cache: a warning, the torch path, and
    generation still works.  The build fails on the background thread the engine starts it on
    (build_in_background) and is reported when the kernels load."""
    code = (
        "from roofline.cpu import ops as cpu_ops\n"
        "from roofline.attention.selector import get_attention_backend\n"
        "assert cpu_ops.build_in_background('auto')\n"
        "assert not cpu_ops.available()\n"
        "assert get_attention_backend('auto', 'cpu').name == 'torch'\n"
        "print('fallback ok')\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "fallback ok" in r.stdout
    assert "native CPU kernels unavailable" in r.stderr


def test_a_build_started_in_the_background_is_the_one_the_kernels_load(tmp_path):
    """build_in_background (the engine's first step on a CPU) compiles on its own thread; the first kernel
    call waits for that build instead of compiling again; a cached build is not started twice.  A fresh
    process and an empty cache; the portable build (any x86 or ARM machine compiles it)."""
    code = (
        "import threading\n"
        "from roofline.cpu import ops as cpu_ops\n"
        "calls = []\n"
        "compile_ = cpu_ops._compile\n"
        "def counted(*a):\n"
        "    calls.append(threading.current_thread().name)\n"
        "    compile_(*a)\n"
        "cpu_ops._compile = counted\n"
        "assert cpu_ops.build_in_background('portable')\n"
        "assert not cpu_ops.build_in_background('portable')  # in flight\n"
        "cpu_ops.select_isa('portable')\n"
        "assert cpu_ops.available() and cpu_ops.loaded_isa() == 'portable'\n"
        "assert calls == ['roofline-kernels-portable'], calls\n"
        "assert not cpu_ops.build_in_background('portable')  # cached now\n"
        "print('background build ok')\n"
    )
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "background build ok" in r.stdout


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (64, 3000, True), (7, 5, True), (1536, 2100, False),
                                      (101, 37, True)])
def test_gemv_matches_linear(threads, k, n, bias):
    """Each thread sums a run of weight rows (uneven runs: k=101 over 2 or 3 threads), then the partials
    are added up per column."""
    g = torch.Generator().manual_seed(k + n)
    weight = torch.randn(k, n, generator=g).t()  # [out x in] values, stored [in x out]-major
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(1, k, generator=g)
    assert cpu_ops.can_gemv(x, weight) and not cpu_ops.can_gemv(x, weight.contiguous())
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_ops.gemv(x, weight, b)
    finally:
        torch.set_num_threads(saved)
    torch.testing.assert_close(got, F.linear(x, weight, b), atol=1e-4, rtol=1e-5)


def test_decode_out_must_be_contiguous():
    meta, q, k, v, cache, _ = make_batch([(5, 1), (9, 1)], block_size=4, num_heads=2, num_kv_heads=1, head_dim=8)
    assert cpu_ops.can_decode(q, cache) and not cpu_ops.can_decode(q.double(), cache)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_ops.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.3,
                                       out=torch.empty(2, 8, 2).transpose(1, 2))


def test_cpu_attention_backend_needs_the_kernels_and_the_cpu():
    with cpu_ops.forced(False):
        with pytest.raises(ValueError, match="native CPU kernels"):
            get_attention_backend("cpu", "cpu")
        assert get_attention_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="CPU only"):
        get_attention_backend("cpu", "cuda")
    assert get_attention_backend("cpu", "cpu").name == "cpu"


def test_attention_portable_build_without_simd_intrinsics(portable_kernels, monkeypatch):
    """Built without -march=native (no AVX2: e.g. aarch64), decode and prefill attention and the row
    argmax take their plain C loops, with the same results."""
    monkeypatch.setattr(cpu_ops, "_lib", portable_kernels)
    monkeypatch.setattr(cpu_ops, "_tried", True)
    meta, q, k, v, cache, _ = make_batch([(20, 1), (3, 1)] + PREFILLS, block_size=16, num_heads=9, num_kv_heads=3,
                                         head_dim=32)
    got, expected = run_both(meta, q, k, v, cache, CpuAttentionBackend())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    x = torch.randn(5, 1000)
    x[1, [3, 700]] = 50.0
    x[2, 9] = float("nan")
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("n", [1, 7, 16, 49152 + 5])
@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_rows_matches_torch(n, threads):
    g = torch.Generator().manual_seed(n)
    wide = torch.randn(9, n + 3, generator=g)
    x = wide[:, :n]  # strided rows
    x[1] = 0.5  # all equal: the first index
    x[2] = float("-inf")
    if n > 1:
        x[3, [n // 3, n // 2, n - 1]] = 100.0  # ties across lanes and the tail: the first one
        x[4, [0, n - 1]] = float("nan")  # the first NaN wins
        x[5, n - 1] = float("nan")
        x[6, n // 2] = float("inf")
        x[7, n - 1] = float("inf")
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_ops.argmax_rows(x)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got, x.argmax(dim=-1))


def test_argmax_rows_declines_what_it_cannot_take():
    assert cpu_ops.argmax_rows(torch.randn(3, 5).double()) is None
    assert cpu_ops.argmax_rows(torch.randn(5, 3).t()) is None  # rows not unit-stride
    assert cpu_ops.argmax_rows(torch.randn(4)) is None


def test_builds_are_chosen_at_run_time():
    """--cpu-isa: the best build this CPU runs by default; another one on request (loaded in place of the
    first, same values within fp32 rounding); a build the CPU cannot run, or an unknown one, is refused."""
    from roofline.cpu import gguf_quant
    from tests.reference.quantized import random_blocks

    isas = cpu_ops.supported_isas()
    assert isas[-1] == "portable"
    assert cpu_ops.available() and cpu_ops.loaded_isa() == isas[0]
    w = random_blocks(3, 40, 256, seed=4)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    best = gguf_quant.linear(x, w)
    try:
        cpu_ops.select_isa("portable")
        assert cpu_ops.available() and cpu_ops.loaded_isa() == "portable"
        torch.testing.assert_close(gguf_quant.linear(x, w), best, atol=1e-4, rtol=1e-5)
    finally:
        cpu_ops.select_isa("auto")
    assert cpu_ops.available() and cpu_ops.loaded_isa() == isas[0]
    with pytest.raises(ValueError, match="cpu_isa"):
        cpu_ops.select_isa("sse2")
    missing = [i for i in ("avx512", "avx2", "neon") if i not in isas]
    if missing:
        with pytest.raises(ValueError, match="does not run on this CPU"):
            cpu_ops.select_isa(missing[0])


@pytest.mark.parametrize("machine,flags,want", [
    ("aarch64", "", ["neon", "portable"]),
    ("arm64", "", ["neon", "portable"]),
    ("x86_64", "avx2 fma f16c", ["avx2", "portable"]),
    ("x86_64", "avx512f avx512bw avx512vl avx512dq avx2 fma f16c", ["avx2", "portable"]),  # no VNNI: AVX2
    ("x86_64", "sse4_2", ["portable"]),
    ("riscv64", "", ["portable"]),
])
def test_the_builds_a_machine_runs(monkeypatch, machine, flags, want):
    """An ARM machine takes the NEON build (its values checked under qemu by scripts/neon_checks.sh), an
    AVX-512 CPU without VNNI the AVX2 one, anything else the plain C build."""
    monkeypatch.setattr(cpu_ops.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu_ops, "_cpu_flags", lambda: flags)
    assert cpu_ops.supported_isas() == want


def test_portable_build_greedy_matches_hf(tiny_models):
    """--cpu-isa portable (the plain C loops, as on CPUs without AVX2): the engine's greedy tokens are
    still HF transformers'; the next engine with --cpu-isa auto loads the best build again."""
    from roofline import LLM, SamplingParams
    from tests.reference.hf_models import hf_greedy, random_prompts

    path, hf = tiny_models["llama"]
    prompts = random_prompts(3, 384, 3, 30, seed=9)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    try:
        llm = LLM(path, dtype="float32", device="cpu", num_kv_blocks=64, show_progress=False, cpu_isa="portable")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        assert cpu_ops.loaded_isa() == "portable"
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        cpu_ops.select_isa("auto")
    assert cpu_ops.available() and cpu_ops.loaded_isa() == cpu_ops.supported_isas()[0]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_vector_build_gives_the_packed_gemm_the_same_values(threads):
    """The AVX-512 build's GEMM tiles hold a row's 16 columns in one register where the AVX2 build takes
    two, and take two adjacent panels at a time: each column's FMA chain over k is the same, so the values
    agree bit for bit -- bias, a zero-padded last panel, the SiLU epilogue's gate, odd panel counts (a
    lone last panel beside the pairs) and K chunks (13 and 37 rows: one row block of several tiles)."""
    g = torch.Generator().manual_seed(5)
    k, n, d = 200, 90, 80  # n: six panels, the last partial; d: five gate and five up panels
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    w_gate_up = torch.randn(2 * d, k, generator=g)
    xs = [torch.randn(m, k, generator=g) for m in (1, 5, 13, 37, 130)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = {isa: ([cpu_ops.gemm_packed(x, cpu_ops.pack_panels(w), n, bias) for x in xs],
                         [cpu_ops.gemm_packed_silu_mul(x, cpu_ops.pack_panels(w_gate_up), d) for x in xs[1:]])
                   for isa in each_vector_build()}
    finally:
        torch.set_num_threads(before)
    builds = list(results)
    for isa in builds[1:]:
        for kind in range(2):
            for got, want in zip(results[isa][kind], results[builds[0]][kind]):
                assert torch.equal(got, want), (isa, kind)
    plain, fused = results[builds[0]]
    for x, y in zip(xs, plain):
        torch.testing.assert_close(y, torch.nn.functional.linear(x.double(), w.double(), bias.double()).float(),
                                   atol=1e-4, rtol=1e-4)
    for x, y in zip(xs[1:], fused):
        gate, up = (x.double() @ w_gate_up.double().t()).split(d, dim=1)
        torch.testing.assert_close(y, (torch.nn.functional.silu(gate) * up).float(), atol=1e-4, rtol=1e-4)


def test_every_vector_build_gives_prefill_attention_the_same_values():
    """Prefill attention keeps its scores transposed (keys x query columns): each score is one FMA chain over the
    head dimension, each column's softmax and P.V chains run over the keys in order, whatever the vector width
    (8 columns and 16 dims a tile in the AVX2 build, 16 and 32 in the AVX-512 one) -- so the builds agree bit for
    bit, plain and with a sliding window, a soft-cap and sinks, over partial tiles (17 positions of 64 heads, a
    100-token chunk of 8/2 heads) and both sides of the keys every column sees."""
    from roofline.attention.backend import AttentionOptions

    g = torch.Generator().manual_seed(11)
    cases = []
    for c, s, h, hk, d in ((32, 700, 9, 3, 64), (100, 100, 8, 2, 128), (40, 300, 4, 4, 32), (17, 500, 64, 1, 16)):
        nb = (s + 15) // 16 + 2
        kv, q = torch.randn(2, nb, 16, hk, d, generator=g), torch.randn(c, h, d, generator=g)
        tables = torch.randperm(nb, generator=g)[:(s + 15) // 16].to(torch.int32).view(1, -1)
        for opts in (None, AttentionOptions(sliding_window=64), AttentionOptions(logit_softcap=20.0),
                     AttentionOptions(sinks=torch.randn(h, generator=g))):
            cases.append((q, kv, tables, torch.tensor([0, c], dtype=torch.int32), torch.tensor([s], dtype=torch.int32),
                          opts))
    results = {}
    for isa in each_vector_build():
        outs = []
        for q, kv, tables, qsl, lens, opts in cases:
            out = torch.empty_like(q)
            cpu_ops.paged_prefill_attention(q, kv, tables, qsl, lens, 0.1, out, opts)
            outs.append(out)
        results[isa] = outs
    builds = list(results)
    for isa in builds[1:]:
        for i, (got, want) in enumerate(zip(results[isa], results[builds[0]])):
            assert torch.equal(got, want), (isa, i)
