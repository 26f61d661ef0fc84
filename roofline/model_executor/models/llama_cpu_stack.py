"""The Llama family's decoder layers as one native call per step on the CPU.

The torch modules (llama.py) run a layer as a dozen native kernels called from Python: RMSNorm, the
packed QKV GEMM, per-head q/k norm (Qwen3), rope, the cache write, decode and prefill attention, the
O projection, RMSNorm, the fused gate/up+SiLU GEMM, the down projection.  At decode batch sizes the
Python between them (~400 calls a step, their tensor allocations, views and checks) costs ~8-10 ms a
step of the default model, next to ~100 ms of kernels for 64 rows and ~30 ms for a few.
`CpuLayerStack` hands the whole stack to cpu_kernels.c `llama_stack_f32`, which calls the same
kernels in the same order with the same arguments: its hidden states are bit-identical to the module
path (tested), only the interpreter is gone.

It applies (`attach` sets `model.model.cpu_stack`) to an fp32 model on the CPU with the native kernels
loaded, tensor_parallel_size 1, the 'cpu' attention backend, every projection packed or kept in GGUF
blocks (then quant_kernels.c multiplies it, and a gate/up projection runs before silu_and_mul, as in the
modules), a gate/up
projection without bias whose halves are 16-aligned and a head size that is a multiple of 16; and
per step (`takes`) to batches of 2 or more rows and to single rows (one stream decoding), which go
through the native GEMV over the dense [in x out]-major weights there as in the modules.
A step with LoRA adapter rows (roofline/lora: `lora_state`, set by the worker's slot manager) runs here
too: the projections' LoRALayer slots go to the kernel in a second table (`_lora_table`) with the step's
adapter groups, and each delta is added right after its projection by the same kernel LoRALayer.apply
calls (lora_kernels.c), a gate/up projection with an adapter running unfused as in the modules -- so the
values stay bit-identical to the module path in these steps as well.
Anywhere else the modules run, and they stay the reference.  Switch: --cpu-layer-stack
(on by default; `SWITCH.forced(False)` for A/B runs).
"""

from __future__ import annotations

from typing import Optional

import torch

from roofline.attention import kv_spec
from roofline.attention.backend import PLAIN, AttentionMetadata
from roofline.config import Switch
from roofline.cpu import ops as cpu_ops
from roofline.cpu.gguf_quant import QuantizedTensor

SWITCH = Switch("cpu_layer_stack")

# per-layer address slots, in the order of the enum in cpu_kernels.c
(IN_NORM, QKV, QKV_BIAS, Q_NORM, K_NORM, O, O_BIAS, POST_NORM, GATE_UP, DOWN, DOWN_BIAS,
 QKV_DENSE, O_DENSE, GATE_UP_DENSE, DOWN_DENSE, K_CACHE, V_CACHE,
 QKV_QUANT, O_QUANT, GATE_UP_QUANT, DOWN_QUANT, QUANT_TYPES) = range(22)
FIELDS = 22
LORA_FIELDS = 6  # per projection's LoRA slots: a, bt, slice count, slice offsets, sizes, slice_on (C enum)


def _gemv_layout(weight: torch.Tensor) -> bool:
    """A dense weight [out, in] stored [in x out]-major, as cpu_ops.gemv reads it (cpu_prepare.relayout)."""
    return weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) == weight.shape[0]


def _projections(layer) -> tuple:
    """A decoder layer's four projections, in the order of their table slots."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


def _shared(layers, value):
    """value(layer), the same for every layer (supports() checked it)."""
    values = {value(layer) for layer in layers}
    if len(values) != 1:
        raise ValueError(f"layers differ: {sorted(values)}")
    return values.pop()


def _addr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


class CpuLayerStack:
    """Runs LlamaModel's layers and final norm for one step in one native call (see the module doc)."""

    def __init__(self, model) -> None:
        inner = model.model
        layers = list(inner.layers)
        spec = kv_spec.uniform(model.kv_cache_specs())  # the cache tensors' shape comes from the spec
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_size
        self.num_heads = _shared(layers, lambda layer: layer.self_attn.num_heads)
        self.hidden = model.config.hidden_size
        self.intermediate = _shared(layers, lambda layer: layer.mlp.gate_up_proj.weight.shape[0] // 2)
        self.rot = _shared(layers, lambda layer: layer.self_attn.rotary.rotary_dim)
        self.scale = float(_shared(layers, lambda layer: layer.self_attn.scale))
        self.eps = float(inner.norm.eps)
        self.final_norm = inner.norm.weight.detach()
        self.table = torch.zeros((len(layers), FIELDS), dtype=torch.int64)
        self._keep = []  # every addressed tensor, alive as long as the table
        # a single row takes the modules' GEMV route over the dense weights where they have its layout
        # (a projection kept in GGUF blocks takes the quantized kernels' GEMV, as in the module)
        self.single_rows = all(lin.quant is not None or _gemv_layout(lin.weight) for layer in layers
                               for lin in _projections(layer))
        for i, layer in enumerate(layers):
            a, m = layer.self_attn, layer.mlp
            slots = ((QKV_DENSE, QKV_QUANT, a.qkv_proj), (O_DENSE, O_QUANT, a.o_proj),
                     (GATE_UP_DENSE, GATE_UP_QUANT, m.gate_up_proj), (DOWN_DENSE, DOWN_QUANT, m.down_proj))
            for j, (dense_slot, quant_slot, lin) in enumerate(slots):
                if lin.quant is not None:
                    self._keep.append(lin.quant.data)
                    self.table[i, quant_slot] = lin.quant.data.data_ptr()
                    self.table[i, QUANT_TYPES] |= lin.quant.kernel_type << (8 * j)
                elif self.single_rows:
                    w = lin.weight.detach()
                    self._keep.append(w)
                    self.table[i, dense_slot] = w.data_ptr()
            row = {
                IN_NORM: layer.input_layernorm.weight, QKV: a.qkv_proj.cpu_packed, QKV_BIAS: a.qkv_proj.bias,
                Q_NORM: a.q_norm.weight if a.q_norm is not None else None,
                K_NORM: a.k_norm.weight if a.k_norm is not None else None,
                O: a.o_proj.cpu_packed, O_BIAS: a.o_proj.bias, POST_NORM: layer.post_attention_layernorm.weight,
                GATE_UP: m.gate_up_proj.cpu_packed, DOWN: m.down_proj.cpu_packed, DOWN_BIAS: m.down_proj.bias,
            }
            for slot, t in row.items():
                if t is not None:
                    t = t.detach()
                    if not t.is_contiguous():
                        raise ValueError(f"layer {i}: a weight the layer stack reads is not contiguous")
                    self._keep.append(t)
                self.table[i, slot] = _addr(t)
        self._cache_ptrs: tuple = ()
        self._layers = layers
        self.lora_state = None  # lora/layers.LoRAStepState of a model serving adapters
        self._lora = None  # (table, rank) of the projections' LoRA slots, built at the first adapter step

    @staticmethod
    def supports(model) -> Optional[str]:
        """None when the stack can run this model, else why not."""
        from roofline.attention.cpu_backend import CpuAttentionBackend

        inner = getattr(model, "model", None)
        if not (getattr(inner, "is_first_stage", True) and getattr(inner, "is_last_stage", True)):
            return "pipeline parallel (a stage holds part of the layers)"
        layers = list(getattr(inner, "layers", []))
        if not layers:
            return "no decoder layers"
        if not cpu_ops.available():
            return "native CPU kernels not loaded"
        if cpu_ops.llama_stack_fields() != FIELDS:
            return "the kernel's per-layer fields do not match"
        specs = model.kv_cache_specs()
        if any(spec.kind != "attention" for spec in specs) or len(set(specs)) != 1:
            return "layers do not all cache K/V of one shape"
        if getattr(inner, "embedding_multiplier", 1.0) != 1.0 or getattr(model, "logits_divisor", 1.0) != 1.0:
            return "embedding or logits multipliers (Granite)"
        for i, layer in enumerate(layers):
            a, m = layer.self_attn, layer.mlp
            if not hasattr(layer, "input_layernorm") or getattr(a, "full_qk_norm", False):
                return f"layer {i} is not a pre-norm Llama layer (OLMo 2's post-norms and whole-projection q/k norms)"
            if not getattr(a, "attn_options", PLAIN).plain:
                return f"layer {i}: a sliding window, soft-capped logits or sinks (the stack attends plainly)"
            if getattr(m, "activation", "silu") != "silu":
                return f"layer {i}: a {m.activation} gate (the stack's MLP is SwiGLU)"
            if not getattr(a, "use_rope", True):
                return f"layer {i} attends without rope (SmolLM3's no_rope_layers)"
            if getattr(layer, "residual_multiplier", 1.0) != 1.0:
                return f"layer {i}: a residual multiplier (Granite)"
            if not hasattr(m, "gate_up_proj"):
                return f"layer {i}: the feed-forward block is not a dense MLP (mixture of experts)"
            if not isinstance(a.backend, CpuAttentionBackend):
                return f"attention backend {a.backend.name!r}, not 'cpu'"
            if a.o_proj.tp_size != 1 or a.qkv_proj.tp_size != 1:
                return "tensor parallel"
            if any(lin.quant is not None and not isinstance(lin.quant, QuantizedTensor) for lin in _projections(layer)):
                return f"layer {i}: a projection is kept in FP8 blocks (the stack's kernels take GGUF blocks)"
            if any(lin.quant is None and (lin.cpu_packed is None or lin.weight.dtype != torch.float32)
                   for lin in _projections(layer)):
                return f"layer {i}: a projection is neither a packed fp32 weight nor kept in GGUF blocks"
            if m.gate_up_proj.bias is not None or (m.gate_up_proj.weight.shape[0] // 2) % cpu_ops.PANEL:
                return "gate/up projection with a bias or halves not 16-aligned"
            if specs[i].head_size % cpu_ops.PANEL or a.num_heads % specs[i].num_kv_heads:
                return "head size not a multiple of 16, or query heads not a multiple of KV heads"
            norms = [layer.input_layernorm, layer.post_attention_layernorm] + [n for n in (a.q_norm, a.k_norm) if n]
            if any(n.eps != inner.norm.eps for n in norms):
                return "layers differ in norm eps"
        for what in (lambda layer: layer.self_attn.num_heads, lambda layer: layer.self_attn.scale,
                     lambda layer: layer.self_attn.rotary.rotary_dim, lambda layer: layer.mlp.gate_up_proj.weight.shape[0]):
            if len({what(layer) for layer in layers}) != 1:
                return "layers differ in query heads, attention scale, rope width or MLP width"
        return None

    def takes(self, x: torch.Tensor) -> bool:
        """Whether this step's batch goes through the stack."""
        rows = x.shape[0]
        return (SWITCH.on() and x.dtype == torch.float32 and x.is_cpu and cpu_ops.available()
                and (rows >= 2 or rows == 1 and self.single_rows)
                and not (self.lora_state is not None and self.lora_state.active and self._lora_table() is None))

    def _lora_table(self) -> Optional[tuple[torch.Tensor, int]]:
        """(int64 [layers, 4, fields]: each projection's LoRALayer slot tensors, 0 where it has none; the slots'
        rank), or None where the kernel cannot read them (not fp32 contiguous CPU tensors)."""
        if self._lora is None:
            if cpu_ops.llama_stack_lora_fields() != LORA_FIELDS:
                self._lora = (None, 0)
                return None
            table = torch.zeros((len(self._layers), 4, LORA_FIELDS), dtype=torch.int64)
            ranks = set()
            for i, layer in enumerate(self._layers):
                for j, lin in enumerate(_projections(layer)):
                    lo = lin.lora
                    if lo is None:
                        continue
                    if not all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in (lo.a, lo.bt)):
                        self._lora = (None, 0)
                        return None
                    ranks.add(lo.a.shape[2])
                    table[i, j] = torch.tensor([lo.a.data_ptr(), lo.bt.data_ptr(), len(lo.slices),
                                                    lo.slice_off_t.data_ptr(), lo.slice_size_t.data_ptr(),
                                                    lo.slice_on_t.data_ptr()])
            self._lora = (table, ranks.pop()) if len(ranks) == 1 else (None, 0)
        return None if self._lora[0] is None else self._lora

    def _lora_step(self, rows: int, kept_rows: int):
        """This step's LoRA argument of cpu_ops.llama_stack (None without adapter rows)."""
        state = self.lora_state
        if state is None or not state.active:
            return None
        table, rank = self._lora_table()
        batch = state.batch

        def groups(segments):  # int64 [G, 4] (slot, rank, first row, end row)
            return torch.tensor([(slot, state.ranks[slot], s, e) for slot, s, e in segments],
                                dtype=torch.int64).reshape(-1, 4)

        return table, rank, groups(batch.segments_for(rows)), groups(batch.segments_for(kept_rows))

    def _bind_caches(self, kv_caches: list[torch.Tensor]) -> None:
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs == self._cache_ptrs:
            return
        if len(kv_caches) != self.table.shape[0]:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.table.shape[0]} layers")
        for i, c in enumerate(kv_caches):
            if (c.dtype != torch.float32 or not c.is_contiguous() or c.dim() != 5
                    or tuple(c.shape[3:]) != (self.num_kv_heads, self.head_dim) or c.shape[0] != 2):
                raise ValueError(f"KV cache {i} is not a contiguous fp32 [2, blocks, block_size, "
                                 f"{self.num_kv_heads}, {self.head_dim}] tensor")
            self.table[i, K_CACHE] = c[0].data_ptr()
            self.table[i, V_CACHE] = c[1].data_ptr()
        self.dims = torch.tensor([self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate,
                                  self.rot, kv_caches[0].shape[2]], dtype=torch.int64)
        self._cache_ptrs = ptrs

    def __call__(self, x: torch.Tensor, cos_sin, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                 output_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [N, d] embedded tokens -> [N, d] hidden states after the final norm, or [K, d] for the
        increasing row indices output_rows (as LlamaModel.forward)."""
        self._bind_caches(kv_caches)
        n = x.shape[0]
        cos, sin = cos_sin
        cos, sin = cos.reshape(n, self.rot).contiguous(), sin.reshape(n, self.rot).contiguous()
        x = x.contiguous()
        rows = n if output_rows is None else output_rows.shape[0]
        out = torch.empty((rows, self.hidden), dtype=torch.float32)
        cpu_ops.llama_stack(x, out, self.table, self.dims, self.eps, self.scale, self.final_norm, cos, sin,
                            meta.slot_mapping, meta.num_decodes, meta.query_start_loc, meta.seq_lens,
                            meta.block_tables, output_rows, self._lora_step(n, rows))
        return out


def attach(model) -> Optional[CpuLayerStack]:
    """Give a loaded Llama-family CPU model its layer stack where it applies; returns it (or None)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "cpu_stack"):
        return None
    inner.cpu_stack = None
    if CpuLayerStack.supports(model) is None:
        inner.cpu_stack = CpuLayerStack(model)
    return inner.cpu_stack
