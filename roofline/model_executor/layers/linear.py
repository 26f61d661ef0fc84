"""Linear layers that know their tensor-parallel shard and load their own slice of a checkpoint.

Column-parallel: the output dimension is split; each rank holds weight rows [rank*n/tp, (rank+1)*n/tp).
Row-parallel: the input dimension is split; partial products are summed by one all-reduce.
QKV-parallel: Q heads split on head boundaries, KV heads split too or replicated when tp > num_kv_heads.

A quantized weight may stay in its format (`load_weight`; layers/quantization): the layer then holds
`quant`, its `weight` becomes a meta tensor (shape and dtype only: nothing reads values that are not there)
and forward computes on the blocks natively.  GGUF blocks (gguf_quant.QuantizedTensor) stay on a CPU layer
of one rank; FP8 blocks (quantization/fp8.Fp8BlockTensor) on a CPU fp32 layer with the native kernels or a
CUDA layer, at any tensor-parallel size: the bytes and their scales are sliced like the rows and columns of a
dense weight (per-row scales while assembling), and a shard of the input dimension must not cut a block.
A layer marked `dense_only` (MLA's kv_b_proj, transformed at load) dequantizes whatever it is given.

LoRA (roofline/lora): a layer may carry `lora` (lora/layers.LoRALayer), which adds the step's adapter rows'
deltas to the layer's own product -- the one place adapters enter the model; a row-parallel layer adds its
partial delta before the all-reduce.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from roofline.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from roofline.cpu import gemm as cpu_gemm
from roofline.cpu import ops as cpu_ops
from roofline.cpu.gguf_quant import QuantizedTensor
from roofline.model_executor.layers.quantization.fp8 import Fp8BlockTensor


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.cpu_packed: Optional[torch.Tensor] = None  # set by cpu_prepare.pack_model after loading (CPU)
        self.quant = None  # the weight kept quantized (load_weight): GGUF or FP8 blocks
        self._dense_loaded = False  # a dense shard went into `weight`: blocks are no longer kept
        self.dense_only = False  # always dequantize (a weight transformed after loading: MLA's kv_b_proj)
        self.lora = None  # lora/layers.LoRALayer when the engine serves LoRA adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_gemm.linear(x, self.weight, self.cpu_packed, self.bias, self.quant)
        return y if self.lora is None else self.lora.apply(x, y)

    def takes_quantized(self) -> bool:
        """Whether GGUF blocks can stay here: a CPU layer of one rank (a shard of the input dimension
        would cut blocks; the native kernels run on the CPU)."""
        return (getattr(self, "tp_size", 1) == 1 and self.weight.device.type in ("cpu", "meta")
                and not self.dense_only)

    def takes_fp8(self) -> bool:
        """Whether FP8 blocks can stay here: the CPU in fp32 with the native kernels, or CUDA (Triton)."""
        device = self.weight.device.type
        if self.dense_only:
            return False
        if device == "cuda":
            return True
        return device in ("cpu", "meta") and self.weight.dtype == torch.float32 and cpu_ops.available()

    def _to_dense(self) -> None:
        """Blocks kept so far become the dense weight (rows not loaded yet are 0 and are overwritten later)."""
        if self.quant is not None:
            self.weight = nn.Parameter(self.quant.dequantize().to(self.weight.dtype), requires_grad=False)
            self.quant = None

    def _load_fp8(self, loaded: Fp8BlockTensor, shard_id) -> None:
        if self.quant is None and not self._dense_loaded and self.takes_fp8():
            device = "cpu" if self.weight.device.type == "meta" else self.weight.device
            self.quant = Fp8BlockTensor.empty(tuple(self.weight.shape), loaded.block_k, loaded.block_n, device)
            self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta"),
                                       requires_grad=False)
        if isinstance(self.quant, Fp8BlockTensor) and self.quant.block_k == loaded.block_k:
            self._check_column_shard(loaded)
            self.weight_loader(self.quant.data, loaded.data.to(self.quant.device), shard_id)
            self.weight_loader(self.quant.scale, loaded.row_scales().to(self.quant.device), shard_id)
            return
        self._to_dense()
        self._dense_loaded = True
        self.weight_loader(self.weight, loaded.dequantize().to(self.weight.dtype), shard_id)

    def _check_column_shard(self, loaded: Fp8BlockTensor) -> None:
        """A shard of the input dimension (RowParallelLinear at tp > 1) must hold whole FP8 column blocks."""
        cols = self.weight.shape[1]
        if cols != loaded.shape[1] and cols % loaded.block_k:
            raise ValueError(f"tensor parallelism gives each rank {cols} of the {loaded.shape[1]} input columns, "
                             f"which cuts the {loaded.block_k}-column FP8 blocks (a rank's share must be a multiple "
                             f"of {loaded.block_k}); use a tensor_parallel_size that keeps whole blocks, or "
                             "--quantized-weights dequantize")

    def load_weight(self, loaded, shard_id=None) -> None:
        """weight_loader for the weight that keeps a GGUF tensor's blocks (gguf_quant.QuantizedTensor)
        where takes_quantized(): its rows go where weight_loader puts fp32 rows (at tp 1 the loaders move
        whole rows only).  A shard in another format than the ones before it (community files mix Q4_K
        and Q6_K within a layer), or a dense one, turns the layer back into fp32, and it stays fp32."""
        if isinstance(loaded, Fp8BlockTensor):
            self._load_fp8(loaded, shard_id)
            return
        quantized = isinstance(loaded, QuantizedTensor)
        if quantized and self.quant is None and not self._dense_loaded and self.takes_quantized():
            self.quant = QuantizedTensor.empty(self.weight.shape[0], self.weight.shape[1], loaded.qtype)
            self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta"),
                                       requires_grad=False)
        if quantized and isinstance(self.quant, QuantizedTensor) and self.quant.qtype == loaded.qtype:
            self.weight_loader(self.quant.data, loaded.data, shard_id)
            return
        self._to_dense()
        self._dense_loaded = True
        self.weight_loader(self.weight, (loaded.dequantize() if quantized else loaded).to(self.weight.dtype), shard_id)

    def weight_bytes(self) -> int:
        """Bytes this layer's weight occupies as computed on (blocks, or the dense tensor)."""
        return self.quant.nbytes if self.quant is not None else self.weight.numel() * self.weight.element_size()


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """y = x W^T, W's rows (outputs) split across ranks; output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None):
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        super().__init__(in_features, _divide(out_features, self.tp_size, "output features"), bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one weight (gate and up projections)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, dtype=None):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        tp = self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        n = self.output_sizes[shard_id] // tp
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q, K, V projections; each rank holds its query heads and their KV heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, dtype=None):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if tp >= num_kv_heads:
            if tp % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({tp}) must be a multiple of num_key_value_heads ({num_kv_heads}) "
                    "when it exceeds it"
                )
            self.num_kv_heads = 1  # replicated: ranks r*kv/tp share KV head r // (tp/kv)
            self.kv_replicas = tp // num_kv_heads
        else:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        self.tp_size, self.tp_rank = tp, get_tp_rank()
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        LinearBase.__init__(self, hidden_size, out, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        d = self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            offset, n, start = 0, q_size, self.tp_rank * q_size
        else:
            offset = q_size if shard_id == "k" else q_size + kv_size
            n = kv_size
            start = (self.tp_rank // self.kv_replicas) * kv_size
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, start, n))


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x_r W_r^T: input features split; one all-reduce joins the partials."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None, reduce_results: bool = True):
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.reduce_results = reduce_results
        super().__init__(_divide(in_features, self.tp_size, "input features"), out_features, bias, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: added once, after the reduction
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_gemm.linear(x, self.weight, self.cpu_packed, quant=self.quant)
        if self.lora is not None:  # this rank's partial delta joins its partial product
            y = self.lora.apply(x, y)
        if self.reduce_results:
            y = tp_all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
