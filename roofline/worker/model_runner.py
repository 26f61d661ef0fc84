"""ModelRunner: turns a SchedulerOutput into one flat forward pass and sampled tokens.

Flat batch for R requests with C_r new tokens each (N = sum C_r rows, no padding):
    input_ids [N], positions [N], slot_mapping [N]
    query_start_loc [R+1] (cu_seqlens of the queries), seq_lens [R] (= S_r + C_r), block_tables [R x B]
Decodes (C_r = 1) are placed first so attention backends can batch them.  Logits are computed only
at the rows that sample (the last row of a request that reached its last known token) and at the
prompt rows of requests that asked for prompt logprobs.

Data-parallel attention: DP ranks run different batches but their expert-parallel MoE layers exchange
tokens with every rank, so every rank runs exactly one pass per step: its batch's forward, or -- with
nothing to run while another DP rank runs -- join_expert_exchanges (no tokens of its own; it still
computes its experts for the tokens the others send).

Speculative decoding: a request verifying k drafts feeds 1 + k tokens and samples at all 1 + k rows;
the RejectionSampler keeps the accepted drafts and adds the target's own token.  After sampling, the
proposer (roofline/spec_decode) guesses the next step's drafts of every sampled request.

LoRA adapters (roofline/lora): a new request's adapter is loaded when it arrives (a bad one fails that
request alone); each step the requests are grouped by adapter (decodes still first) and the slot manager
gets the step's rows by adapter once, before the forward pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional

import numpy as np
import torch

from roofline.attention.backend import AttentionMetadata
from roofline.distributed import pipeline
from roofline.distributed.parallel_state import get_pp_group
from roofline.core.scheduler_output import (
    ModelRunnerOutput,
    PositionLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from roofline.model_executor.layers import gpu_sampler
from roofline.model_executor.layers.gpu_sampler import GpuSampler
from roofline.model_executor.layers.moe.layer import join_expert_exchanges
from roofline.model_executor.layers.sampler import NO_TOKEN, Sampler, SamplingState, prompt_logprobs_rows
from roofline.spec_decode.proposer import ProposalBatch, Proposer, TargetForward
from roofline.spec_decode.rejection_sampler import RejectionSampler, greedy_accept
from roofline.structured_output.bitmask import apply_token_bitmask, bitmask_tensor

logger = logging.getLogger(__name__)

NO_TOKEN_ERROR = ("no token could be sampled: every token was masked (the structured-output constraint and "
                  "min_tokens' stop-token suppression left none) or the logits were not numbers")


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, swap_caches: Optional[list[torch.Tensor]] = None,
                 block_caches: Optional[list[torch.Tensor]] = None, kv_layout=None) -> None:
        """kv_caches: each layer's cache; block_caches: the distinct tensors behind them (a hybrid layout's slot
        tensors, which block swaps and copies move; default kv_caches), swap_caches matching them;
        kv_layout: attention/kv_spec.KVCacheLayout (its groups' block tables go to the layers), or None."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_caches = block_caches if block_caches is not None else kv_caches
        self.kv_layout = kv_layout if kv_layout is not None and kv_layout.grouped else None
        self.swap_caches = swap_caches
        self.block_size = block_size
        self.device = device
        on_gpu = device.type == "cuda"
        self.sampler = GpuSampler() if on_gpu else Sampler()  # same tokens; GpuSampler: one sync per step
        self.prompt_logprobs_rows = gpu_sampler.prompt_logprobs_rows if on_gpu else prompt_logprobs_rows
        self.graph_runner = None  # CudaGraphRunner for decode-only steps, set by the Worker (CUDA)
        self.states: dict[str, SamplingState] = {}
        self.proposer: Optional[Proposer] = None  # speculative decoding, set by the Worker
        self.rejection_sampler = RejectionSampler()
        self.draft_probs: dict[str, torch.Tensor] = {}  # q of a request's pending drafts (sampled proposers)
        self.lora = None  # lora/manager.LoRAModelSlots when serving LoRA adapters, set by the Worker
        self.req_lora: dict = {}  # req_id -> its LoRARequest (requests under an adapter)
        pp = get_pp_group()
        # pipeline stages: all but the first receive (hidden, residual), all but the last send them on
        self.receives_hidden, self.samples = not pp.is_first_rank, pp.is_last_rank
        self.stage_wait_s = 0.0  # time spent waiting for the previous stage's hidden states (idle)

    @property
    def model_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    # ---- block movement ----------------------------------------------------------------------
    def _move_blocks(self, out: SchedulerOutput) -> None:
        """Swaps and copy-on-write copies, in the target's pool and a draft model's (same block ids)."""
        caches = self.block_caches + (self.proposer.kv_caches if self.proposer is not None else [])
        if out.blocks_to_swap_out:
            src = torch.tensor([d for d, _ in out.blocks_to_swap_out], device=self.device)
            dst = torch.tensor([c for _, c in out.blocks_to_swap_out])
            for cache, swap in zip(caches, self.swap_caches):
                swap[:, dst] = cache[:, src].to("cpu")
        if out.blocks_to_swap_in:
            src = torch.tensor([c for c, _ in out.blocks_to_swap_in])
            dst = torch.tensor([d for _, d in out.blocks_to_swap_in], device=self.device)
            for cache, swap in zip(caches, self.swap_caches):
                cache[:, dst] = swap[:, src].to(self.device)
        if out.blocks_to_copy:
            src = torch.tensor([s for s, _ in out.blocks_to_copy], device=self.device)
            dst = torch.tensor([d for _, d in out.blocks_to_copy], device=self.device)
            for cache in caches:
                cache[:, dst] = cache[:, src]

    def _update_states(self, out: SchedulerOutput) -> dict[str, str]:
        """Drop finished requests' states and set up the new ones'; returns the requests whose state
        could not be set up (req_id -> error): they fail alone, the rest of the step runs."""
        failed: dict[str, str] = {}
        for rid in out.finished_req_ids:
            self.states.pop(rid, None)
            self.draft_probs.pop(rid, None)
            self.req_lora.pop(rid, None)
        for new in out.new_requests:
            if new.lora is not None:
                try:
                    if self.lora is None:
                        raise ValueError("LoRA is not enabled on this engine")
                    self.lora.load(new.lora)
                except Exception as e:  # its adapter cannot be applied: it fails, never runs on the base model
                    logger.warning("request %s: LoRA adapter %r failed: %s", new.req_id, new.lora.lora_name, e)
                    failed[new.req_id] = f"LoRA adapter {new.lora.lora_name!r} could not be loaded: {e}"
                    continue
                self.req_lora[new.req_id] = new.lora
            try:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(new.generator_seed)
                self.states[new.req_id] = SamplingState(
                    spec=new.sampling,
                    generator=gen,
                    prompt_token_ids=new.prompt_token_ids,
                    output_token_ids=list(new.output_token_ids),
                )
            except Exception as e:  # a request the worker cannot sample for: fail it, keep the batch
                logger.warning("request %s: sampling state failed: %s", new.req_id, e)
                failed[new.req_id] = f"could not set up sampling: {type(e).__name__}: {e}"
        return failed

    def _lora_id(self, req_id: str) -> int:
        lora = self.req_lora.get(req_id)
        return lora.lora_int_id if lora is not None else 0

    # ---- the step ----------------------------------------------------------------------------
    def _prepare(self, items: list[ScheduledRequest]):
        bs = self.block_size
        lens = [len(s.token_ids) for s in items]
        n = sum(lens)
        input_ids = np.empty(n, dtype=np.int64)
        positions = np.empty(n, dtype=np.int64)
        slots = np.empty(n, dtype=np.int64)
        qsl = [0]
        seq_lens = []
        max_blocks = max(len(s.block_ids) for s in items)
        tables = np.zeros((len(items), max_blocks), dtype=np.int32)
        off = 0
        for r, s in enumerate(items):
            c = lens[r]
            pos = np.arange(s.num_computed_tokens, s.num_computed_tokens + c, dtype=np.int64)
            table = np.asarray(s.block_ids, dtype=np.int64)
            input_ids[off : off + c] = s.token_ids
            positions[off : off + c] = pos
            slots[off : off + c] = table[pos // bs] * bs + pos % bs
            tables[r, : len(s.block_ids)] = s.block_ids
            off += c
            qsl.append(off)
            seq_lens.append(s.num_computed_tokens + c)
        dev = self.device
        meta = AttentionMetadata(
            num_tokens=n,
            num_reqs=len(items),
            num_decodes=sum(1 for c in lens if c == 1),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=max(lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            state_slots_cpu=[s.state_slot for s in items] if items[0].state_slot >= 0 else None,
        )
        if self.kv_layout is not None and items[0].group_block_ids:
            meta.group_metas = [self._group_meta(meta, items, g) for g in range(self.kv_layout.num_groups)]
            meta.group_of_layer = self.kv_layout.group_of_layer
        return torch.from_numpy(input_ids).to(dev), torch.from_numpy(positions).to(dev), meta

    def _group_meta(self, meta: AttentionMetadata, items: list[ScheduledRequest], g: int) -> AttentionMetadata:
        """The step's metadata for block-table group g of a hybrid layout: its tables and slots."""
        bs = self.block_size
        width = max(len(s.group_block_ids[g]) for s in items)
        tables = np.zeros((len(items), width), dtype=np.int32)
        slots = np.empty(meta.num_tokens, dtype=np.int64)
        off = 0
        for r, s in enumerate(items):
            table = s.group_block_ids[g]
            tables[r, : len(table)] = table
            pos = np.arange(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids), dtype=np.int64)
            slots[off : off + len(pos)] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
            off += len(pos)
        return replace(meta, block_tables=torch.from_numpy(tables).to(self.device),
                       slot_mapping=torch.from_numpy(slots).to(self.device))

    def _grammar_masks(self, out: SchedulerOutput, req_ids: list[str]):
        """Structured outputs: a function that masks the logits of req_ids' rows (given which of them the
        logits hold) with the step's grammar bitmask; None when no row is constrained."""
        if out.grammar_bitmask is None:
            return None
        mask = bitmask_tensor(out.grammar_bitmask, len(out.grammar_req_ids), self.device)
        mask_row = {rid: j for j, rid in enumerate(out.grammar_req_ids)}

        def constrain(logits: torch.Tensor, which: list[int]) -> None:
            pairs = [(k, mask_row[req_ids[i]]) for k, i in enumerate(which) if req_ids[i] in mask_row]
            if pairs:
                sel = [j for _, j in pairs]
                rows_mask = mask if sel == list(range(mask.shape[0])) else mask[torch.tensor(sel, device=mask.device)]
                apply_token_bitmask(logits, [k for k, _ in pairs], rows_mask)

        return constrain

    def _sample(self, hidden: torch.Tensor, rows: list[int], states: list[SamplingState], constrain=None):
        """Tokens (and logprobs) of hidden's rows: rows that only need the argmax ask the model for greedy
        tokens without the full logits (greedy_head.py, where it applies); the rest go through the LM head,
        the grammar bitmask (constrained rows) and the sampler."""
        tokens: list[Optional[int]] = [None] * len(rows)
        lps: list[Optional[PositionLogprobs]] = [None] * len(rows)
        plain = [i for i, st in enumerate(states) if st.plain_greedy]
        greedy_tokens = getattr(self.model, "greedy_tokens", None)
        if plain and greedy_tokens is not None:
            got = greedy_tokens(hidden, [rows[i] for i in plain])
            if got is not None:
                for i, tok in zip(plain, got.tolist()):
                    tokens[i] = tok
        rest = [i for i, tok in enumerate(tokens) if tok is None]
        if rest:
            logits = self.model.compute_logits(hidden[torch.tensor([rows[i] for i in rest], device=hidden.device)])
            if constrain is not None:
                constrain(logits, rest)
            rest_tokens, rest_lps = self.sampler(logits, [states[i] for i in rest])
            for i, tok, lp in zip(rest, rest_tokens, rest_lps):
                tokens[i], lps[i] = tok, lp
        return tokens, lps

    def _verify(self, hidden: torch.Tensor, rows: list[list[int]], states: list[SamplingState],
                drafts: list[list[int]], req_ids: list[str]):
        """Speculative requests: rows[i] are request i's 1 + k rows; returns per request the emitted tokens
        and their logprobs (rejection_sampler.py).  Plain greedy requests skip the full logits."""
        flat = [r for rr in rows for r in rr]
        greedy_tokens = getattr(self.model, "greedy_tokens", None)
        if greedy_tokens is not None and all(st.plain_greedy for st in states):
            got = greedy_tokens(hidden, flat)
            if got is not None:
                argmax, emitted, off = got.tolist(), [], 0
                for d in drafts:
                    emitted.append(greedy_accept(d, argmax[off : off + len(d) + 1]))
                    off += len(d) + 1
                return emitted, [None] * len(states)
        logits = self.model.compute_logits(hidden[torch.tensor(flat, device=hidden.device)])
        probs = [self.draft_probs.get(rid) for rid in req_ids]
        probs = [q[: len(d)] if q is not None else None for q, d in zip(probs, drafts)]
        return self.rejection_sampler(logits, states, drafts, probs if any(q is not None for q in probs) else None)

    def _target_step(self, items: list[ScheduledRequest], req_ids: list[str], emitted: list[list[int]]):
        """A model-based proposer's view of the step's sampled requests (draft_model.TargetStep)."""
        from roofline.spec_decode.draft_model import TargetStep

        by_id = {s.req_id: s for s in items}
        next_position = {}
        for rid, toks in zip(req_ids, emitted):
            s = by_id[rid]
            # known tokens fed + accepted drafts are in the KV; the newest token is not yet
            next_position[rid] = s.num_computed_tokens + len(s.token_ids) - s.num_draft_tokens + len(toks) - 1
        return TargetStep(next_position, {r: by_id[r].block_ids for r in req_ids},
                          {r: self.states[r] for r in req_ids}, self._prepare)

    def _propose(self, req_ids: list[str], k: int, target) -> list[list[int]]:
        """The next step's drafts of each sampled request (none for grammar-constrained ones)."""
        asked = [i for i, rid in enumerate(req_ids) if not self.states[rid].spec.structured]
        drafts: list[list[int]] = [[] for _ in req_ids]
        if not asked:
            return drafts
        states = [self.states[req_ids[i]] for i in asked]
        got = self.proposer.propose(ProposalBatch([req_ids[i] for i in asked],
                                                  [st.prompt_token_ids + st.output_token_ids for st in states],
                                                  k, target))
        for j, i in enumerate(asked):
            drafts[i] = got.token_ids[j]
            q = got.probs[j] if got.probs is not None else None
            if q is not None:
                self.draft_probs[req_ids[i]] = q
            else:
                self.draft_probs.pop(req_ids[i], None)
        return drafts

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, join_exchanges_when_idle: bool = False) -> ModelRunnerOutput:
        """join_exchanges_when_idle: another data-parallel rank runs a batch this step, so a step with
        nothing to run here still joins the expert-parallel MoE layers' exchanges."""
        failed = self._update_states(out)
        self._move_blocks(out)
        result = ModelRunnerOutput(req_ids=[], sampled_token_ids=[], logprobs=[], prompt_logprobs={}, failed=failed)
        items = [s for s in out.scheduled if s.req_id in self.states]
        if not items:
            if join_exchanges_when_idle:
                join_expert_exchanges(self.model)
            return result
        # decodes first (stable order otherwise); with LoRA adapters, each adapter's requests together
        if self.lora is not None:
            items.sort(key=lambda s: (len(s.token_ids) != 1, self._lora_id(s.req_id)))
        else:
            items.sort(key=lambda s: len(s.token_ids) != 1)
        qsl = np.cumsum([0] + [len(s.token_ids) for s in items]).tolist()
        sample_rows, sample_reqs, sample_drafts = [], [], []  # rows: per request its 1 + k sampling rows
        prompt_lp_jobs = []  # (req_id, first row, rows, next tokens, k)
        for r, s in enumerate(items):
            q0, q1 = qsl[r], qsl[r + 1]
            st = self.states[s.req_id]
            if st.spec.prompt_logprobs is not None and s.num_computed_tokens < len(st.prompt_token_ids):
                # row at position p predicts prompt token p+1
                p0 = s.num_computed_tokens
                p1 = min(s.num_computed_tokens + (q1 - q0), len(st.prompt_token_ids) - 1)
                if p1 > p0:
                    prompt_lp_jobs.append((s.req_id, q0, p1 - p0, st.prompt_token_ids[p0 + 1 : p1 + 1],
                                           st.spec.prompt_logprobs))
                else:
                    result.prompt_logprobs[s.req_id] = []
            if s.sample:
                k = s.num_draft_tokens
                sample_rows.append(list(range(q1 - 1 - k, q1)))
                sample_reqs.append(s.req_id)
                sample_drafts.append(s.token_ids[len(s.token_ids) - k :] if k else [])

        graph_out = self.graph_runner.run(items) if self.graph_runner is not None else None
        prepared = None
        if graph_out is not None:  # decode-only batch replayed in a CUDA graph, logits included
            hidden = graph_out.hidden
        else:
            # only the rows read below leave the model (a chunk's earlier rows skip its last layer's MLP)
            wanted = sorted(set().union(*sample_rows, *(range(j[1], j[1] + j[2]) for j in prompt_lp_jobs)))
            prepared = input_ids, positions, meta = self._prepare(items)
            stage_input = {}
            if self.receives_hidden:  # [N, d] hidden and residual from the previous pipeline stage
                t0 = time.perf_counter()
                stage_input["intermediate"] = pipeline.recv_from_prev_stage(
                    qsl[-1], self.model.config.hidden_size, self.model_dtype, self.device)
                self.stage_wait_s += time.perf_counter() - t0
            kept = len(wanted) < qsl[-1] and not (self.proposer is not None and self.proposer.needs_target_hidden)
            if self.lora is not None:  # the step's rows by adapter, for every LoRA layer
                self.lora.begin_step([(self.req_lora.get(s.req_id), len(s.token_ids)) for s in items],
                                     wanted if kept else None)
            try:
                if kept:
                    at = {row: i for i, row in enumerate(wanted)}
                    sample_rows = [[at[row] for row in rows] for rows in sample_rows]
                    prompt_lp_jobs = [(rid, at[row0], n, nxt, k) for rid, row0, n, nxt, k in prompt_lp_jobs]
                    hidden = self.model(input_ids, positions, self.kv_caches, meta,
                                        torch.tensor(wanted, dtype=torch.int64, device=self.device), **stage_input)
                else:
                    hidden = self.model(input_ids, positions, self.kv_caches, meta, **stage_input)  # [N, d]
            finally:
                if self.lora is not None:
                    self.lora.end_step()
            if not self.samples:  # a pipeline stage before the last: hand on (hidden, residual), done
                pipeline.send_to_next_stage(*hidden)
                return result
        for rid, row0, count, next_tokens, k in prompt_lp_jobs:
            logits = self.model.compute_logits(hidden[row0 : row0 + count])
            result.prompt_logprobs[rid] = self.prompt_logprobs_rows(logits, next_tokens, k)
        if sample_reqs:
            states = [self.states[rid] for rid in sample_reqs]
            emitted: list[list[int]] = [[] for _ in sample_reqs]
            emitted_lps: list = [None] * len(sample_reqs)
            one = [i for i, d in enumerate(sample_drafts) if not d]  # one token each: the Sampler
            if one:
                rids = [sample_reqs[i] for i in one]
                constrain = self._grammar_masks(out, rids)
                if graph_out is not None:
                    logits = graph_out.logits[torch.tensor([sample_rows[i][0] for i in one], device=hidden.device)]
                    if constrain is not None:
                        constrain(logits, list(range(len(one))))
                    tokens, lps = self.sampler(logits, [states[i] for i in one])
                else:
                    tokens, lps = self._sample(hidden, [sample_rows[i][0] for i in one], [states[i] for i in one],
                                               constrain)
                for i, tok, lp in zip(one, tokens, lps):
                    if tok == NO_TOKEN:  # nothing allowed (sampler.py): this request fails, no id goes on
                        result.failed[sample_reqs[i]] = NO_TOKEN_ERROR
                        continue
                    emitted[i], emitted_lps[i] = [tok], ([lp] if lp is not None else None)
            spec = [i for i, d in enumerate(sample_drafts) if d]  # verifying drafts: the RejectionSampler
            if spec:
                tokens, lps = self._verify(hidden, [sample_rows[i] for i in spec], [states[i] for i in spec],
                                           [sample_drafts[i] for i in spec], [sample_reqs[i] for i in spec])
                for i, toks, lp in zip(spec, tokens, lps):
                    emitted[i], emitted_lps[i] = toks, lp
            for st, toks in zip(states, emitted):
                st.output_token_ids.extend(toks)
            kept = [i for i, rid in enumerate(sample_reqs) if rid not in result.failed]
            if len(kept) < len(sample_reqs):
                sample_reqs, emitted, emitted_lps = ([x[i] for i in kept] for x in (sample_reqs, emitted, emitted_lps))
            result.req_ids = sample_reqs
            result.sampled_token_ids = emitted
            result.logprobs = emitted_lps
        if self.proposer is not None and self.proposer.needs_target_step:  # every step: its K/V follows ours
            self.proposer.follow_target(TargetForward(
                *(prepared if prepared is not None else self._prepare(items)), items=items,
                states={s.req_id: self.states[s.req_id] for s in items},
                hidden=hidden if self.proposer.needs_target_hidden else None))
        if sample_reqs:
            if self.proposer is not None and out.num_tokens_to_propose > 0:
                target = (self._target_step(items, sample_reqs, emitted)
                          if self.proposer.needs_target_step else None)
                result.draft_token_ids = self._propose(sample_reqs, out.num_tokens_to_propose, target)
        return result
