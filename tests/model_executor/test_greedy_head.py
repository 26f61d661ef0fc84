"""The LM head's int8 screen for greedy rows (greedy_head.py, cpu_kernels.c greedy_head_f32): the
tokens are those of the full fp32 logits' argmax (first maximum) on every route, the bound it relies on
holds, rescoring reproduces the route's logits bit for bit, and the engine takes it for plain greedy
rows only."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.cpu import gemm as cpu_gemm, ops as cpu_ops, greedy_head
from roofline.cpu.greedy_head import GreedyScreen, route_runs_for
from tests.reference.isa_builds import each_vector_build

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="native CPU kernels not built here")


def lm_head(v: int, k: int, seed: int, outliers: bool = True):
    """A random LM head weight stored [in x out]-major (as cpu_prepare.relayout leaves it) and its panels."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, k, generator=g) * 0.05
    if outliers:
        w[:, 3] *= 30  # a large input dimension, as real embeddings have
        w[5] = 0.0  # a zero row
        w[9] = w[4]  # exact ties
    dense = w.t().contiguous().t()
    return dense, cpu_ops.pack_panels(dense)


def hidden(r: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(r, k, generator=g) * 2
    h[:, 3] *= 25  # an outlier feature, as after a real model's final norm
    return h


def full_argmax(h, dense, packed):
    return cpu_ops.argmax_rows(cpu_gemm.linear(h, dense, packed))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 16])
@pytest.mark.parametrize("v,k", [(1000, 96), (331, 45), (4099, 64)])
def test_tokens_are_the_full_logits_argmax(v, k, rows, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dense, packed = lm_head(v, k, seed=v + k)
        screen = GreedyScreen.build(dense, v)
        for trial in range(3):
            h = hidden(rows, k, seed=100 * trial + rows)
            if rows > 2:
                h[1] = 0.0  # every logit 0: the first token wins
                h[2] = torch.randn(k) * 3e-42  # so small that max|h| / 32767 underflows to 0
            runs = route_runs_for(h, dense, packed)
            assert runs == (0 if rows >= 2 else greedy_head.gemv_runs(k, threads))
            got = screen.tokens(h, packed, dense, runs)
            assert torch.equal(got, full_argmax(h, dense, packed))
    finally:
        torch.set_num_threads(before)


def test_near_ties_and_exact_ties_pick_the_full_paths_first_maximum():
    """Tokens whose logits differ in the last bits: only an exact reproduction of the route's sums
    picks the same one as the full logits."""
    k, v = 64, 512
    g = torch.Generator().manual_seed(7)
    base = torch.randn(k, generator=g)
    w = base.repeat(v, 1) + torch.randn(v, k, generator=g) * 1e-7  # all logits within ~1e-6 of each other
    w[17] = w[300]  # and an exact tie
    dense = w.t().contiguous().t()
    packed = cpu_ops.pack_panels(dense)
    screen = GreedyScreen.build(dense, v)
    for rows in (1, 4):
        h = torch.randn(rows, k, generator=g)
        cand = torch.zeros(rows, dtype=torch.int64)
        got = screen.tokens(h, packed, dense, route_runs_for(h, dense, packed), cand)
        assert torch.equal(got, full_argmax(h, dense, packed))
        assert int(cand.min()) > 10  # many tokens had to be rescored


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rescoring_reproduces_each_routes_logits_bit_for_bit(threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        v, k = 700, 83
        dense, packed = lm_head(v, k, seed=3)
        ids = torch.arange(v)
        h = hidden(3, k, seed=4)
        batch = cpu_gemm.linear(h, dense, packed)  # the packed route
        for r in range(3):
            assert torch.equal(cpu_ops.route_logits(h[r], ids, packed, dense, 0), batch[r])
        one = cpu_gemm.linear(h[:1], dense, packed)  # the GEMV route
        assert torch.equal(cpu_ops.route_logits(h[0], ids, packed, dense, greedy_head.gemv_runs(k, threads)), one[0])
    finally:
        torch.set_num_threads(before)


def q8_0_weight(v: int, k: int, seed: int) -> torch.Tensor:
    """W = d_b q with int8 q and an fp16 scale per 32 inputs (GGUF Q8_0), stored [in x out]-major."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (v, k), generator=g).float()
    q[:, ::32] = 127.0  # each block reaches the full range, as the Q8_0 quantizer makes it
    d = torch.rand(v, k // 32, generator=g).half().float() * 2.0**-10  # fp16 scales: q d exact in fp32
    return (q * d.repeat_interleave(32, dim=1)).t().contiguous().t()


@pytest.mark.parametrize("case", ["outlier weights", "exact weights, coarse h"])
def test_the_bound_holds_for_every_token(case):
    """|F_v - A_v| <= B_v for the screen's approximations A (the kernel's scratch) and the fp32 logits F,
    and the kernel rescored exactly the tokens this bound cannot rule out (with exact weights and one huge
    feature, the hidden state's rounding term decides how many)."""
    v, k, rows = 3000, 192, 6
    if case == "outlier weights":
        dense, packed = lm_head(v, k, seed=11)
        h = hidden(rows, k, seed=12)
    else:
        dense = q8_0_weight(v, k, seed=13)
        dense[:, 7] = 0.0  # the huge feature sets h's scale but adds nothing to the logits
        packed = cpu_ops.pack_panels(dense)
        h = hidden(rows, k, seed=14)
        h[:, 7] = 3e4
    screen = GreedyScreen.build(dense, v)
    approx = torch.empty(rows, v)
    out, cand = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int64)
    assert cpu_ops.greedy_head(h, screen, packed, dense, 0, approx, out, cand) == 0
    f = cpu_gemm.linear(h, dense, packed)
    t = h.abs().amax(dim=1) / greedy_head.HQ_MAX  # as the kernel quantizes (fp32)
    hq = torch.round(h / t[:, None]).clamp(-greedy_head.HQ_MAX, greedy_head.HQ_MAX)
    hn = h.double().norm(dim=1)
    dn = (h.double() - t.double()[:, None] * hq.double()).norm(dim=1)
    bound = hn[:, None] * screen.bound_w.double() + dn[:, None] * screen.bound_q.double() + 1e-5 * approx.double().abs()
    slack = bound - (f.double() - approx.double()).abs()
    assert (slack >= 0).all(), float(slack.min())
    assert torch.equal(out, cpu_ops.argmax_rows(f))
    a = approx.double()
    reach = (a + bound) >= (a - bound).max(dim=1, keepdim=True).values
    assert cand.tolist() == reach.sum(dim=1).tolist()
    if case != "outlier weights":
        assert int(cand.max()) > 1


def test_weights_from_q8_0_blocks_are_held_exactly():
    """Q8_0 weights: the int8 copy is exact, the bound's weight term is only the rounding allowance."""
    v, k = 256, 96
    w = q8_0_weight(v, k, seed=5)
    screen = GreedyScreen.build(w, v)
    c = (2 * (k + 64) + 4 * (2 * (k // 32) + 8)) * 2.0**-24
    assert (screen.bound_w.double() <= c * w.double().norm(dim=1) * (1 + 2e-5)).all()


def test_non_finite_rows_and_weights_fall_back():
    dense, packed = lm_head(200, 32, seed=1)
    screen = GreedyScreen.build(dense, 200)
    h = hidden(3, 32, seed=2)
    h[1, 5] = float("nan")
    assert screen.tokens(h, packed, dense, 0) is None
    h[1, 5] = float("inf")
    assert screen.tokens(h, packed, dense, 0) is None
    bad = dense.clone()
    bad[3, 3] = float("inf")
    assert GreedyScreen.build(bad, 200) is None


def test_only_small_fp32_batches_on_known_routes_take_it():
    dense, packed = lm_head(300, 32, seed=1)
    h = hidden(greedy_head.MAX_ROWS + 1, 32, seed=2)
    assert route_runs_for(h[:1].double(), dense, packed) is None  # the full path would run torch's F.linear
    assert route_runs_for(h[:2], dense, None) is None  # no packed weight: MKL
    assert route_runs_for(h[:1], dense.contiguous(), packed) is None  # row-major weight: not the native GEMV


def test_portable_build_gives_the_same_tokens(portable_kernels):
    """Built without -march=native (no AVX2), the screen's plain C tile and rescoring give the same tokens."""
    lib = portable_kernels
    fn = lib.greedy_head_f32
    v, k, rows = 1000, 70, 5
    dense, packed = lm_head(v, k, seed=21)
    screen = GreedyScreen.build(dense, v)
    h = hidden(rows, k, seed=22)
    logits = torch.empty(rows, v)  # the portable build's own packed GEMM: its tile sums without FMA
    lib.gemm_packed_f32(h.data_ptr(), k, packed.data_ptr(), None, logits.data_ptr(), v, rows, k, v, 2)
    approx, out = torch.empty(rows, v), torch.empty(rows, dtype=torch.int64)
    rc = fn(h.data_ptr(), k, rows, k, v, screen.panels.data_ptr(), screen.scales.data_ptr(), screen.bound_w.data_ptr(),
            screen.bound_q.data_ptr(), screen.wnorm_max, greedy_head.HQ_MAX, packed.data_ptr(), dense.data_ptr(),
            dense.stride(1), 0, approx.data_ptr(), out.data_ptr(), None, 2)
    assert rc == 0 and torch.equal(out, logits.argmax(dim=1))


def test_every_vector_build_gives_the_screen_the_same_values():
    """The AVX-512 build's screen (one vpdpwssd per input pair for a panel's 16 tokens) and the AVX2
    build's (vpmaddwd on two halves) take the same exact int32 block sums and the same float products
    and sums lane for lane: the approximations agree bit for bit, and so do the tokens.  The odd K leaves
    a part block at the end, the rows cover tiles of one, two and three."""
    v, k = 1000, 75
    dense, packed = lm_head(v, k, seed=31)
    screen = GreedyScreen.build(dense, v)
    h = hidden(7, k, seed=32)
    results = {}
    for isa in each_vector_build():
        for rows in (1, 2, 3, 7):
            approx, out = torch.empty(rows, v), torch.empty(rows, dtype=torch.int64)
            assert cpu_ops.greedy_head(h[:rows], screen, packed, dense, 0, approx, out, None) == 0
            assert torch.equal(out, full_argmax(h[:rows], dense, packed)), (isa, rows)
            results[(isa, rows)] = approx
    first = next(iter(results))[0]
    for (isa, rows), approx in results.items():
        assert torch.equal(approx, results[(first, rows)]), (isa, first, rows)
        if rows > 1:  # a row's screen does not depend on the rows tiled with it
            assert torch.equal(approx[0], results[(isa, 1)][0]), (isa, rows)


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    path, _ = tiny_models["llama"]
    return LLM(path, dtype="float32", device="cpu", num_kv_blocks=256, show_progress=False)


def test_engine_takes_the_screen_for_plain_greedy_rows_only(tiny_llm, monkeypatch):
    """Greedy rows without logprobs or penalties go through the screen, the others through the logits;
    the tokens are the same as with the screen switched off, in mixed batches too."""
    from tests.reference.hf_models import random_prompts

    assert tiny_llm.llm_engine.executor.worker.model.lm_head.cpu_greedy is not None
    seen = []
    real = GreedyScreen.tokens

    def counting(self, h, *args, **kw):
        seen.append(h.shape[0])
        return real(self, h, *args, **kw)

    monkeypatch.setattr(GreedyScreen, "tokens", counting)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, 384, 3, 30, seed=8)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[7], min_tokens=5),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    with_screen = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    assert seen and max(seen) <= 3  # rows 0, 5 always, row 4 once past min_tokens: never the others
    seen.clear()
    with greedy_head.SWITCH.forced(False):
        without = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    assert not seen and with_screen == without


def test_cached_screen_is_the_built_one_and_is_read_back(tmp_path, monkeypatch):
    """GreedyScreen.cached: the first call builds and saves, the next reads the file (build is not called)
    and gives the same tensors bit for bit; another weight gets its own entry; a damaged entry is rebuilt."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(greedy_head, "CACHE_MIN_BYTES", 0)  # a small head, cached all the same
    dense, _ = lm_head(200, 96, seed=5)
    built = GreedyScreen.build(dense, 190)
    first = GreedyScreen.cached(dense, 190)
    entries = list((tmp_path / "roofline").glob("greedy-head-*.safetensors"))
    assert len(entries) == 1

    def no_build(*a, **k):
        raise AssertionError("built again instead of read from the cache")

    monkeypatch.setattr(GreedyScreen, "build", staticmethod(no_build))
    again = GreedyScreen.cached(dense, 190)
    for screen in (first, again):
        for name in ("panels", "scales", "bound_w", "bound_q"):
            assert torch.equal(getattr(screen, name), getattr(built, name)), name
        assert (screen.vocab, screen.k, screen.wnorm_max) == (built.vocab, built.k, built.wnorm_max)
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(greedy_head, "CACHE_MIN_BYTES", 0)
    other, _ = lm_head(200, 96, seed=6)
    GreedyScreen.cached(other, 190)
    assert len(list((tmp_path / "roofline").glob("greedy-head-*.safetensors"))) == 2
    entries[0].write_bytes(b"not a safetensors file")
    rebuilt = GreedyScreen.cached(dense, 190)
    assert torch.equal(rebuilt.panels, built.panels)
