"""CUDA-graph decode path (roofline/worker/cuda_graph.py), the parts that run without a GPU: capture
sizes, the padding plan, the static buffers and metadata, and the static forward itself (run eagerly,
through the Triton interpreter) against the eager ModelRunner forward.  No graph is captured here."""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the attention kernels are defined
    _mod = sys.modules.get("roofline.attention.triton.kernels")
    if _mod is not None and type(_mod._paged_attn_kernel).__name__ != "InterpretedFunction":
        importlib.reload(_mod)
pytest.importorskip("triton")

from roofline.core.scheduler_output import ScheduledRequest  # noqa: E402
from roofline.worker import cuda_graph as cg  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_capture_sizes():
    assert cg.capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    assert cg.capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cg.capture_sizes(16) == [1, 2, 4, 8, 16]
    assert cg.capture_sizes(3) == [1, 2, 3]
    assert cg.capture_sizes(1) == [1]
    assert cg.capture_sizes(256, limit=40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert cg.capture_sizes(0) == []


def test_padded_size():
    sizes = cg.capture_sizes(64)
    assert [cg.padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 63, 64)] == [1, 2, 4, 8, 8, 16, 16, 24, 64, 64]
    assert cg.padded_size(65, sizes) is None
    assert cg.padded_size(0, sizes) is None


def _req(rid, pos, blocks, tok=5):
    return ScheduledRequest(req_id=rid, num_computed_tokens=pos, token_ids=[tok], block_ids=blocks, sample=True)


def test_decode_only():
    assert cg.is_decode_only([_req("a", 3, [0]), _req("b", 0, [1])])
    prefill = ScheduledRequest(req_id="c", num_computed_tokens=0, token_ids=[1, 2], block_ids=[2], sample=True)
    assert not cg.is_decode_only([_req("a", 3, [0]), prefill])
    assert not cg.is_decode_only([])


def test_plan_pads_rows():
    bs = 4
    items = [_req("a", 5, [7, 3], tok=11), _req("b", 0, [9], tok=12), _req("c", 8, [1, 2, 6], tok=13)]
    plan = cg.plan_decode_batch(items, bs, batch_size=4, max_blocks=8, scratch_block=0)
    assert plan.num_reqs == 3 and plan.batch_size == 4
    assert plan.input_ids.tolist() == [11, 12, 13, 0]
    assert plan.positions.tolist() == [5, 0, 8, 0]
    # slot = block_table[pos // bs] * bs + pos % bs; padding -> -1 (write skipped)
    assert plan.slot_mapping.tolist() == [3 * 4 + 1, 9 * 4 + 0, 6 * 4 + 0, -1]
    assert plan.seq_lens.tolist() == [6, 1, 9, 1]
    assert plan.block_tables.tolist() == [[7, 3, 0], [9, 0, 0], [1, 2, 6], [0, 0, 0]]
    plan = cg.plan_decode_batch(items[:1], bs, batch_size=2, max_blocks=8, scratch_block=5)
    assert plan.block_tables.tolist() == [[7, 3], [5, 0]] and plan.seq_lens.tolist() == [6, 1]
    # a table wider than the graph's block-table buffer: no plan (the step runs eagerly)
    assert cg.plan_decode_batch(items, bs, batch_size=4, max_blocks=2) is None


def test_static_inputs_and_metadata():
    st = cg.StaticInputs(max_batch=8, max_blocks=4, device=DEVICE)
    # fresh buffers are all padding rows: nothing would be written to the cache
    assert (st.slot_mapping == -1).all() and (st.seq_lens == 1).all()
    items = [_req("a", 5, [7, 3]), _req("b", 2, [9])]
    st.block_tables.fill_(99)  # stale values from an earlier step
    st.load(cg.plan_decode_batch(items, 4, batch_size=4, max_blocks=4))
    meta = st.metadata(4, max_seq_len=16)
    assert meta.num_tokens == meta.num_reqs == meta.num_decodes == 4
    assert meta.max_query_len == 1 and meta.max_seq_len == 16
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.seq_lens.tolist() == [6, 3, 1, 1]
    assert meta.slot_mapping.tolist() == [13, 38, -1, -1]
    # columns [:width] rewritten (padding rows point at the scratch block); later columns are stale
    # but never read (seq_len <= width * block_size)
    assert meta.block_tables[:, :2].tolist() == [[7, 3], [9, 0], [0, 0], [0, 0]]
    assert meta.block_tables.data_ptr() == st.block_tables.data_ptr()  # views: graph-safe addresses


def _tiny_model(backend, max_pos):
    from roofline.model_executor.models.llama import LlamaForCausalLM
    from tests.reference.hf_models import tiny_config

    cfg = tiny_config("llama", max_position_embeddings=max_pos)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, backend).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model.to(DEVICE), cfg


def test_unsupported_reasons():
    from roofline.attention.torch_backend import TorchAttentionBackend
    from roofline.attention.triton.backend import TritonAttentionBackend

    triton_model, _ = _tiny_model(TritonAttentionBackend(), 64)
    torch_model, _ = _tiny_model(TorchAttentionBackend(), 64)
    assert "enforce_eager" in cg.graphs_unsupported_reason(triton_model, "cuda", enforce_eager=True)
    assert "CUDA" in cg.graphs_unsupported_reason(triton_model, "cpu", enforce_eager=False)
    assert "tensor parallel" in cg.graphs_unsupported_reason(triton_model, "cuda", False, tp_size=2)
    assert "torch" in cg.graphs_unsupported_reason(torch_model, "cuda", enforce_eager=False)
    assert cg.graphs_unsupported_reason(triton_model, "cuda", enforce_eager=False) is None


def test_create_graph_runner_is_none_on_cpu():
    from roofline.attention.triton.backend import TritonAttentionBackend
    from roofline.config import EngineArgs

    model, _ = _tiny_model(TritonAttentionBackend(), 64)
    config = EngineArgs(device="cpu", max_model_len=64).create_engine_config()
    assert cg.create_graph_runner(model, [], config, "cpu") is None


@pytest.mark.parametrize("max_model_len", [64, 1024])  # 1024: the split-KV path is fixed at capture
def test_static_forward_matches_eager(max_model_len):
    """3 decodes padded to a batch of 4: real rows' hidden states and logits match the eager forward,
    and the padding row writes nothing to the KV cache."""
    from roofline.attention.triton.backend import TritonAttentionBackend
    from roofline.worker.model_runner import ModelRunner

    backend = TritonAttentionBackend()
    model, cfg = _tiny_model(backend, max_model_len)
    bs, num_blocks = 16, 12
    hk, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, num_blocks, bs, hk, d, generator=g).to(DEVICE) for _ in range(cfg.num_hidden_layers)]
    items = [_req("a", 20, [5, 2], tok=7), _req("b", 0, [9], tok=8), _req("c", 37, [1, 11, 3], tok=9)]

    eager_caches = [c.clone() for c in caches]
    runner = ModelRunner(model, eager_caches, bs, torch.device(DEVICE))
    with torch.inference_mode():
        ids, pos, meta = runner._prepare(items)
        exp_hidden = model(ids, pos, eager_caches, meta)
        exp_logits = model.compute_logits(exp_hidden)

    graph_caches = [c.clone() for c in caches]
    gr = cg.CudaGraphRunner(model, graph_caches, bs, max_num_seqs=8, max_model_len=max_model_len, device=DEVICE)
    assert gr.sizes == [1, 2, 4, 8]
    meta4 = gr.static.metadata(4, max_model_len)
    expect_splits = 1 if max_model_len < 512 else 4
    assert backend.choose_num_splits(meta4, hk, torch.device(DEVICE)) == expect_splits
    with torch.inference_mode():
        out = gr.run(items)
    assert out is not None and out.query_start_loc_cpu == [0, 1, 2, 3]
    assert out.hidden.shape == exp_hidden.shape and out.logits.shape == exp_logits.shape
    torch.testing.assert_close(out.hidden, exp_hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits, exp_logits, atol=1e-5, rtol=1e-5)
    # the real rows' K/V land in their slots (the values agree to rounding: the GEMMs see 4 rows
    # instead of 3); the padding row writes nothing: every other slot is bit-for-bit unchanged
    real_slots = meta.slot_mapping.tolist()
    for before, a, b in zip(caches, graph_caches, eager_caches):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        changed = (a != before).reshape(2, num_blocks * bs, -1).any(-1).any(0)
        assert set(changed.nonzero().flatten().tolist()) == set(real_slots)

    # a prefill in the batch, or more requests than the largest size: not for the graph
    prefill = ScheduledRequest(req_id="p", num_computed_tokens=0, token_ids=[1, 2], block_ids=[4], sample=True)
    assert gr.run(items + [prefill]) is None
    assert gr.run([_req(str(i), 0, [i]) for i in range(9)]) is None
    assert gr.sizes == [1, 2, 4, 8]
