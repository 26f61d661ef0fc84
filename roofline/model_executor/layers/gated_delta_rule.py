"""Gated DeltaNet's token mixing (Qwen3-Next's linear attention), in torch, as HF transformers' fallback computes it.

Per value head, with a matrix state S [d_k x d_v] (fp32) and per token t: q_t, k_t (L2-normalised, q scaled by
d_k^-1/2), v_t, the decay g_t <= 0 (log space) and the write strength beta_t in (0, 1):
    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
`recurrent_gated_delta_rule` runs it token by token (decode steps), `chunk_gated_delta_rule` in chunks of 64
with the UT transform (prefill chunks); both start from a given state and return the final one, so a prompt
computed in several scheduler chunks advances the state chunk by chunk.

`causal_conv1d`: the depthwise causal convolution before them, continuing from a state that holds the last
kernel - 1 inputs (zeros at a request's start) and returning the new one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _prepare(query, key, value, g, beta):
    """[B, T, H, *] inputs -> fp32 [B, H, T, *], q/k heads repeated to the value heads, q/k L2-normed, q scaled."""
    num_k_heads, num_v_heads = key.shape[2], value.shape[2]
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, g = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g)]
    query, key = l2norm(query), l2norm(key)
    return query * query.shape[-1] ** -0.5, key, value, g, beta


def recurrent_gated_delta_rule(query, key, value, g, beta, initial_state: torch.Tensor):
    """query/key [B, T, H_k, d_k], value [B, T, H_v, d_v], g/beta [B, T, H_v], initial_state [B, H_v, d_k, d_v] fp32
    -> (out [B, T, H_v, d_v] in value's dtype, final state [B, H_v, d_k, d_v] fp32)."""
    out_dtype = value.dtype
    query, key, value, g, beta = _prepare(query, key, value, g, beta)
    state = initial_state.to(torch.float32)
    out = torch.zeros_like(value)
    for i in range(value.shape[2]):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        state = state * g[:, :, i].exp()[..., None, None]
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(out_dtype), state


def chunk_gated_delta_rule(query, key, value, g, beta, initial_state: torch.Tensor, chunk_size: int = 64):
    """The same function as recurrent_gated_delta_rule, computed chunk_size tokens at a time."""
    out_dtype = value.dtype
    query, key, value, g, beta = _prepare(query, key, value, g, beta)
    seq_len = value.shape[2]
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    num_chunks = (seq_len + pad) // chunk_size
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    g = g.reshape(g.shape[0], g.shape[1], -1, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum = g.cumsum(dim=3)
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    state = initial_state.to(new_values)
    out = torch.zeros_like(new_values)
    query = query * cum.exp().unsqueeze(-1)
    key = key * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :seq_len]
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), state


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, activation: bool = True):
    """x [B, C, T] (channels first), state [B, C, K-1] (the previous inputs), weight [C, K] depthwise
    -> (silu(conv(x)) [B, C, T] in x's dtype, the new state [B, C, K-1]: the last K-1 inputs)."""
    full = torch.cat([state.to(weight.dtype), x.to(weight.dtype)], dim=-1)  # [B, C, K-1+T]
    k1 = weight.shape[-1] - 1
    out = F.conv1d(full, weight.unsqueeze(1), None, padding=0, groups=x.shape[1])  # [B, C, T]
    if activation:
        out = F.silu(out)
    return out.to(x.dtype), full[:, :, full.shape[-1] - k1:]
