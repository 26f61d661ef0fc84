"""Weight iterators: safetensors shards, GGUF (dequantized with the gguf package, or 2-D weights kept in
their block format), random (dummy).

Each yields (HF parameter name, tensor) so a model's load_weights reads one naming scheme; with
keep_quantized, a GGUF weight in a format the native kernels take comes as a
gguf_quant.QuantizedTensor (its rows still permuted like an fp32 weight's).  GGUF names: llama.cpp's
llama / mistral / qwen2 / qwen3 / mixtral / qwen2moe / qwen3moe files through the tables below; the
families of gguf_archs.ARCHS (gemma2, gemma3, phi3, olmo2, granite, glm4moe, smollm3, gpt-oss) through theirs.
MXFP4 tensors (gpt-oss's experts) are dequantized by quantization/mxfp4.py, as an HF MXFP4 checkpoint's are.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from roofline.cpu import gguf_quant, ops as cpu_ops
from roofline.cpu.gguf_quant import QuantizedTensor
from roofline.model_executor.layers.quantization import mxfp4


def safetensors_weights(path: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    for f in tqdm(files, desc="Loading safetensors shards", disable=not show_progress or len(files) < 2):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts (llama.cpp's qwen2moe / qwen3moe): router, 3-D expert stacks [E, out, in], shared expert
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


def gguf_name_to_hf(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    m = re.match(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$", name)
    if m and m.group(2) in _GGUF_LAYER:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{m.group(3)}"
    return None  # e.g. rope_freqs: recomputed from the config


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs -> rotate-half halves)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(file: str, hf_config, show_progress: bool = True,
                 keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The file's tensors under HF names, dequantized to fp32; with keep_quantized, the 2-D weights of the
    decoder layers in a format gguf_quant takes stay in their blocks (the embedding, read by rows, and
    the LM head are dequantized)."""
    import gguf

    from roofline.model_executor.loader import gguf_archs
    from roofline.model_executor.loader.gguf_file import GgufTensors

    reader = GgufTensors(file)  # the tensor table only (gguf_file.py): GGUFReader would parse the vocabulary too
    arch = reader.architecture
    mapped = arch in gguf_archs.ARCHS  # else the llama-family tables above
    permute_qk = arch in ("llama", "mistral") or (mapped and gguf_archs.ARCHS[arch].permute_qk)
    n_head = hf_config.num_attention_heads
    n_kv = getattr(hf_config, "num_key_value_heads", None) or n_head
    for t in tqdm(reader.tensors, desc="Reading GGUF tensors", disable=not show_progress):
        name = gguf_archs.tensor_name(arch, t.name, hf_config) if mapped else gguf_name_to_hf(t.name)
        if name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dim first
        in_blocks = len(shape) == 2 and gguf_quant.supported(int(t.tensor_type))  # a format gguf_quant takes
        if keep_quantized and in_blocks and name.startswith("model.layers.") and name.endswith(".weight"):
            w = QuantizedTensor(_permuted_rows(_byte_rows(t, shape), name, permute_qk, n_head, n_kv),
                                int(t.tensor_type), shape[1])
            yield name, w
            continue
        if t.tensor_type == gguf.GGMLQuantizationType.MXFP4:  # HF's blocks again, then HF's dequantization
            try:
                w = mxfp4.from_ggml(_byte_rows(t, shape)).dequantize(torch.float32)
            except ValueError as e:
                raise ValueError(f"GGUF tensor {t.name!r}: {e}") from e
            yield name, w
            continue
        if in_blocks and cpu_ops.available():
            # the kernels' expansion: gguf's values bit for bit (test_expansion_is_exactly_gguf_dequantize),
            # ~10x faster than gguf's numpy (the default model's Q8_0 embedding: 0.43 s)
            dense = gguf_quant.dequantize_native(QuantizedTensor(_byte_rows(t, shape), int(t.tensor_type), shape[1]))
        else:
            dense = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
                                     .reshape(shape))
        w = _permuted_rows(dense, name, permute_qk, n_head, n_kv)
        yield name, gguf_archs.adjust(arch, name, w) if mapped else w


def _byte_rows(t, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor's bytes copied out of the file's mapping, one row per index of its leading dims."""
    return torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(*shape[:-1], -1))


def _permuted_rows(w: torch.Tensor, name: str, permute_qk: bool, n_head: int, n_kv: int) -> torch.Tensor:
    """Q/K weights and biases of llama.cpp's files whose converter permutes them (llama / mistral, and
    gguf_archs' granite / smollm3) back in HF's row order; rows of blocks move as rows of values do."""
    if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute(w, n_head).contiguous()
    if permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute(w, n_kv).contiguous()
    return w


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights, small enough that activations stay finite (norm weights stay at 1).  Drawn on
    the parameters' own device (one generator per device, seeded with `seed`): the same values for the
    same seed on that device, and no host round trip (8B parameters on a GPU: seconds, not minutes)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
            continue
        g = generators.get(p.device)
        if g is None:
            g = generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        draw = torch.empty(p.shape, dtype=torch.float32, device=p.device).uniform_(-0.05, 0.05, generator=g)
        p.data.copy_(draw)
