"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache: see backend.py."""

from roofline.attention.mla.backend import MLAAttentionBackend, MLAWeights, get_mla_backend

__all__ = ["MLAAttentionBackend", "MLAWeights", "get_mla_backend"]
