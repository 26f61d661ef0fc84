"""Command-line flags for every EngineArgs field, named as vLLM names them (--max-num-seqs, -tp, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import typing

from roofline.config import EngineArgs

_SHORT = {"tensor_parallel_size": ["-tp"]}
_HELP = {
    "model": "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "load_format": "auto | safetensors | gguf | dummy (random weights)",
    "gguf_weights": "native (a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K layers stay in their blocks and are "
                    "computed natively on the CPU) | dequantize (fp32 copies, as on GPUs)",
    "kv_cache_memory": "bytes for the KV pool on CPU",
    "num_kv_blocks": "force the number of KV blocks",
    "preemption_mode": "recompute | swap",
    "scheduling_policy": "fcfs | priority",
    "attention_backend": "auto | torch | cpu | triton",
    "tensor_parallel_size": "ranks (processes, one device each) to split every layer over, across all nodes",
    "nnodes": "machines taking part (torchrun-style); each runs tensor_parallel_size/nnodes ranks",
    "node_rank": "this machine's index in [0, nnodes); node 0 runs the engine, others `roofline worker`",
    "master_addr": "address of node 0, where rank 0 hosts the rendezvous",
    "master_port": "rendezvous port on node 0 (a free one on one node; 29500 when unset with nnodes > 1)",
    "distributed_backend": "gloo | nccl for the model's collectives (gloo on CPU, nccl on CUDA when unset)",
    "step_roofline": "live roofline: account each step's bytes and FLOPs against the device's bound "
                     "(/metrics roofline:step_*, /dashboard); --no-step-roofline turns it off",
    "roofline_hardware": "bandwidth/peak for the live roofline: a `roofline plan` preset (h100-sxm, h200, "
                         "a100-80gb, l4) or 'measure'; unset: the matching GPU preset, else measured at start-up",
}


def _base_type(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        tp = _base_type(hints[f.name])
        names = ["--" + f.name.replace("_", "-")] + _SHORT.get(f.name, [])
        help_text = _HELP.get(f.name, "") + f" (default: {f.default})"
        if tp is bool:
            group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=f.default, help=help_text)
        else:
            group.add_argument(*names, dest=f.name, type=tp, default=f.default, help=help_text)


def engine_args_from(ns: argparse.Namespace, **overrides) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)}
    values.update(overrides)
    return EngineArgs(**values)
