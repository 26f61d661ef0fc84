"""MTP speculative decoding on a tiny DeepSeek-V3 checkpoint written by transformers' `save_pretrained`,
with an MTP layer (model.layers.{N}.*) of random weights added beside it.

- The proposals, step by step, equal a reference MTP built from HF transformers' own DeepSeek-V3
  layer on the same weights: at position p it reads the main model's final hidden state and the
  token at p + 1; further drafts re-apply it to its own output.  The proposals are a function of the
  tokens so far (the catch-up rewrites every row the next step reads), so the reference recomputes
  them from the whole sequence each step.
- Greedy output equals HF (and speculation off) in the default, chunked (budget 16), tiny-pool and
  tp=2 settings; every KV block back in the pool; a checkpoint without MTP layers is refused.
"""

from __future__ import annotations

import os

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.config import EngineArgs
from roofline.engine.engine_core import EngineCore
from tests.engine.test_feature_invariance import shared_prefix_prompts
from tests.model_executor.test_deepseek import build_deepseek, ds_config
from tests.reference.hf_models import hf_greedy

V3 = dict(q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def mtp_spec(k: int = 3) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}


class ReferenceMTP:
    """The MTP module in HF terms: a one-layer HF DeepSeek-V3 (first_k_dense_replace=0, so its layer is
    MoE like the MTP layer) holds the block; its final norm plays shared_head.norm."""

    def __init__(self, main, seed: int):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        cfg = ds_config("deepseek_v3", num_hidden_layers=1, first_k_dense_replace=0, **V3)
        self.block = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        h = main.config.hidden_size
        with torch.no_grad():
            for name, p in self.block.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
            for name, b in self.block.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.1)
        self.enorm = 1 + torch.randn(h) * 0.1
        self.hnorm = 1 + torch.randn(h) * 0.1
        self.eh_proj = torch.randn(h, 2 * h) * 0.1
        self.main = main

    def tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of the MTP layer at index `layer` (HF names)."""
        out = {}
        pre = f"model.layers.{layer}."
        for name, t in self.block.state_dict().items():
            if not name.startswith("model.layers.0."):
                continue
            name = name[len("model.layers.0."):]
            if name == "mlp.experts.gate_up_proj":  # per expert, as checkpoints store them
                i = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[pre + f"mlp.experts.{e}.gate_proj.weight"] = t[e, :i]
                    out[pre + f"mlp.experts.{e}.up_proj.weight"] = t[e, i:]
            elif name == "mlp.experts.down_proj":
                for e in range(t.shape[0]):
                    out[pre + f"mlp.experts.{e}.down_proj.weight"] = t[e]
            else:
                out[pre + name] = t
        out[pre + "shared_head.norm.weight"] = self.block.model.norm.weight.detach().clone()
        out[pre + "enorm.weight"], out[pre + "hnorm.weight"] = self.enorm, self.hnorm
        out[pre + "eh_proj.weight"] = self.eh_proj
        # a real V3 checkpoint repeats the main model's embedding and head here: they must be skipped
        out[pre + "embed_tokens.weight"] = torch.zeros_like(self.main.model.embed_tokens.weight)
        out[pre + "shared_head.head.weight"] = torch.zeros_like(self.main.lm_head.weight)
        return {k: v.detach().contiguous() for k, v in out.items()}

    @staticmethod
    def _rms(x, w, eps=1e-6):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    @torch.no_grad()
    def _run(self, next_tokens: torch.Tensor, hidden: torch.Tensor):
        """Rows 0..n-1 (position = row) -> (pre-norm outputs y [n, H], logits [n, V])."""
        emb = self.main.model.embed_tokens(next_tokens)
        emb[0] = 0  # position 0
        x = torch.cat((self._rms(emb, self.enorm), self._rms(hidden, self.hnorm)), -1) @ self.eh_proj.T
        captured = {}
        hook = self.block.model.norm.register_forward_hook(lambda m, a, o: captured.setdefault("y", a[0]))
        try:
            self.block.model(inputs_embeds=x[None])
        finally:
            hook.remove()
        y = captured["y"][0]
        return y, self.main.lm_head(self.block.model.norm(y))

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k greedy proposals after `tokens` (the newest last)."""
        ids = torch.tensor([tokens])
        hidden = self.main.model(ids).last_hidden_state[0]  # the main model's final (normed) hidden states
        nxt = ids[0, 1:].clone()
        h = hidden[:-1]
        out = []
        for _ in range(k):
            y, logits = self._run(nxt, h)
            d = int(logits[-1].argmax())
            out.append(d)
            nxt = torch.cat((nxt, torch.tensor([d])))
            h = torch.cat((h, y[-1:]))
        return out


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """(path, prompts, HF greedy outputs, reference MTP)."""
    from safetensors.torch import save_file

    path = str(tmp_path_factory.mktemp("tiny-v3-mtp"))
    main = build_deepseek("deepseek_v3", path, seed=2, num_nextn_predict_layers=1, **V3)
    ref = ReferenceMTP(main, seed=7)
    save_file(ref.tensors(main.config.num_hidden_layers), os.path.join(path, "mtp.safetensors"))
    prompts = shared_prefix_prompts(main.config.vocab_size, n=4, seed=4)
    return path, prompts, [hf_greedy(main, p, GREEDY.max_tokens) for p in prompts], ref


def test_proposals_equal_the_hf_reference_step_by_step(mtp_checkpoint):
    path, prompts, reference, ref = mtp_checkpoint
    core = EngineCore(EngineArgs(model=path, dtype="float32", device="cpu", num_kv_blocks=64, block_size=8,
                                 max_num_batched_tokens=16, speculative_config=mtp_spec(3)).create_engine_config(),
                      show_progress=False)
    try:
        core.add_request("a", prompts[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        checked = 0
        while core.has_unfinished_requests():
            core.step()
            req = core.scheduler.requests.get("a")
            if req is None or not req.output_token_ids or not req.spec_token_ids:
                continue
            assert req.spec_token_ids == ref.drafts(req.all_token_ids, len(req.spec_token_ids)), checked
            checked += 1
        assert checked >= 3  # after the chunked prefill, then after verify steps
        assert core.scheduler.get_stats().num_free_blocks == 64
    finally:
        core.shutdown()


VARIANTS = {
    "default": dict(num_kv_blocks=128),
    "budget_16": dict(num_kv_blocks=128, max_num_batched_tokens=16),
    "tiny_pool": dict(num_kv_blocks=14, block_size=8, preemption_mode="recompute"),
    "tp2": dict(num_kv_blocks=64, tensor_parallel_size=2),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf(mtp_checkpoint, variant):
    path, prompts, reference, _ = mtp_checkpoint
    llm = LLM(path, dtype="float32", device="cpu", show_progress=False, speculative_config=mtp_spec(2),
              **VARIANTS[variant])
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
        stats = llm.llm_engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.spec_decode.num_draft_tokens > 0
        if variant == "tiny_pool":
            assert stats.num_preemptions > 0
    finally:
        llm.llm_engine.shutdown()


def test_random_sampling_with_mtp_is_reproducible(mtp_checkpoint):
    path, prompts, _, _ = mtp_checkpoint
    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=11, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(path, dtype="float32", device="cpu", show_progress=False, num_kv_blocks=64,
                  speculative_config=mtp_spec(2))
        runs.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                                                                   sp, use_tqdm=False)])
        assert llm.llm_engine.get_stats().spec_decode.num_draft_tokens > 0
    assert runs[0] == runs[1]


def test_a_model_without_mtp_layers_is_refused(tiny_models):
    path, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match="speculative_config.method 'mtp' needs a DeepSeek-V3 / V3.2 checkpoint"):
        LLM(path, device="cpu", num_kv_blocks=16, show_progress=False, speculative_config=mtp_spec(2))
