"""In-process checks of the tensor-parallel layers (no processes): each rank's shard is exactly its
slice of the checkpoint, a forward pass issues exactly 2 all-reduces per decoder layer plus one for
the embedding and one all-gather per logits computation, and bad head splits fail naming the numbers."""

from __future__ import annotations

import contextlib

import pytest
import torch

import roofline.distributed.parallel_state as ps
from roofline.attention.torch_backend import TorchAttentionBackend
from roofline.core.scheduler_output import NewRequestData, SamplingSpec, ScheduledRequest, SchedulerOutput
from roofline.model_executor.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from roofline.worker.model_runner import ModelRunner
from tests.reference.hf_models import tiny_config


@pytest.fixture
def as_rank():
    """as_rank(rank, world): build layers as that rank of a (fake) world; collectives are counted
    no-ops (all-reduce leaves the partial sum, all-gather repeats the local shard)."""

    stack = contextlib.ExitStack()

    def enter(rank: int, world: int):
        stack.close()
        stack.enter_context(ps.tp_group_as(rank, world))
        ps.get_tp_group().group = object()  # a stand-in: the collectives below are faked

    orig_ar, orig_ag = ps.dist.all_reduce, ps.dist.all_gather

    def fake_all_gather(parts, x, group=None):
        for p in parts:
            p.copy_(x)

    ps.dist.all_reduce = lambda x, group=None: None
    ps.dist.all_gather = fake_all_gather
    try:
        yield enter
    finally:
        ps.dist.all_reduce, ps.dist.all_gather = orig_ar, orig_ag
        stack.close()


def _hf_state(arch: str, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **kw), dtype=torch.float32)
    return model.config, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _build(arch, cfg, state):
    cls = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}[arch]
    model = cls(cfg, TorchAttentionBackend())
    loaded = model.load_weights(state.items())
    assert loaded == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return model


@pytest.mark.parametrize("arch,kv_heads,world", [("llama", 2, 2), ("llama", 1, 2), ("qwen3", 2, 2), ("llama", 2, 4)])
def test_each_rank_loads_its_slice(as_rank, arch, kv_heads, world):
    cfg, state = _hf_state(arch, num_key_value_heads=kv_heads)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    hq, hkv = cfg.num_attention_heads // world, max(kv_heads // world, 1)
    replicas = max(world // kv_heads, 1)
    inter = cfg.intermediate_size // world
    vocab = cfg.vocab_size // world
    for rank in range(world):
        as_rank(rank, world)
        model = _build(arch, cfg, state)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert (attn.num_heads, attn.num_kv_heads) == (hq, hkv)
        p = "model.layers.0."
        kv = rank // replicas  # the KV head group this rank serves
        expect_qkv = torch.cat([
            state[p + "self_attn.q_proj.weight"][rank * hq * d:(rank + 1) * hq * d],
            state[p + "self_attn.k_proj.weight"][kv * hkv * d:(kv + 1) * hkv * d],
            state[p + "self_attn.v_proj.weight"][kv * hkv * d:(kv + 1) * hkv * d],
        ])
        assert torch.equal(attn.qkv_proj.weight, expect_qkv)
        heads = slice(rank * hq * d, (rank + 1) * hq * d)
        assert torch.equal(attn.o_proj.weight, state[p + "self_attn.o_proj.weight"][:, heads])
        sl = slice(rank * inter, (rank + 1) * inter)
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([state[p + "mlp.gate_proj.weight"][sl],
                                                               state[p + "mlp.up_proj.weight"][sl]]))
        assert torch.equal(mlp.down_proj.weight, state[p + "mlp.down_proj.weight"][:, sl])
        vs = slice(rank * vocab, (rank + 1) * vocab)
        assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"][vs])
        assert torch.equal(model.lm_head.weight, state["lm_head.weight"][vs])
        # replicated pieces are whole
        assert torch.equal(model.model.norm.weight, state["model.norm.weight"])
        if arch == "qwen3":
            assert torch.equal(attn.q_norm.weight, state[p + "self_attn.q_norm.weight"])


def test_kv_pool_holds_only_this_ranks_heads(as_rank):
    from roofline.worker.worker import kv_bytes_per_block

    cfg, state = _hf_state("llama", num_key_value_heads=2)
    full = kv_bytes_per_block(_build("llama", cfg, state), 16, torch.float32)
    as_rank(1, 2)
    half = kv_bytes_per_block(_build("llama", cfg, state), 16, torch.float32)
    as_rank(1, 4)  # 2 KV heads over 4 ranks: one (replicated) head each
    replicated = kv_bytes_per_block(_build("llama", cfg, state), 16, torch.float32)
    assert half * 2 == full and replicated * 2 == full


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_all_reduces_per_layer(as_rank, arch):
    cfg, state = _hf_state(arch, num_hidden_layers=3)
    as_rank(0, 2)
    model = _build(arch, cfg, state)
    caches = [torch.zeros(2, 8, 16, 1, model.model.layers[0].self_attn.head_dim) for _ in range(3)]
    runner = ModelRunner(model, caches, 16, torch.device("cpu"))
    spec = SamplingSpec(0.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0, None, 0, [], None, None)
    prompt = [5, 6, 7, 8, 9]
    new = [NewRequestData("a", prompt, [], spec, 1), NewRequestData("b", prompt[:2], [], spec, 2)]
    scheduled = [ScheduledRequest("a", 0, prompt, [0], True), ScheduledRequest("b", 0, prompt[:2], [1], True)]
    out = SchedulerOutput(0, new, scheduled, [], [], [], [])
    ps.reset_collective_counts()
    result = runner.execute(out)
    assert len(result.sampled_token_ids) == 2
    # embedding 1 + (attention output 1 + MLP down 1) per layer; one logits all-gather per step
    assert ps.collective_counts() == (1 + 2 * 3, 1)


@pytest.mark.parametrize("heads,kv,world,needle", [
    (4, 2, 3, "num_attention_heads (4) is not divisible by tensor_parallel_size (3)"),
    (6, 2, 3, "tensor_parallel_size (3) must be a multiple of num_key_value_heads (2)"),
    (8, 4, 8, None),  # fine: KV heads replicated twice
])
def test_head_split_errors_name_the_numbers(as_rank, heads, kv, world, needle):
    cfg = tiny_config("llama", num_attention_heads=heads, num_key_value_heads=kv, hidden_size=16 * heads)
    as_rank(0, world)
    if needle is None:
        LlamaForCausalLM(cfg, TorchAttentionBackend())
        return
    with pytest.raises(ValueError) as e:
        LlamaForCausalLM(cfg, TorchAttentionBackend())
    assert needle in str(e.value)


def test_failure_report_puts_the_root_cause_first():
    from roofline.distributed.launch import RankFailure, order_failures
    from roofline.distributed.protocol import Failure

    msg = order_failures([
        Failure(0, "rank 0 (on a) failed: RuntimeError: Connection closed by peer [127.0.0.1]:4242", False),
        RankFailure("tensor-parallel worker rank 2 (pid 9) was killed by SIGKILL"),
        Failure(1, "rank 1 (on b) failed: RuntimeError: CUDA error: an illegal memory access", False),
        Failure(1, "rank 1 (on b) failed: RuntimeError: CUDA error: an illegal memory access", False),
    ])
    parts = msg.split("; ")
    assert len(parts) == 3
    # the rank's own error, then the killed rank (a root cause too), then the peer that lost its connection
    assert parts[0].startswith("rank 1") and "SIGKILL" in parts[1] and "Connection closed" in parts[2]
