"""Command-line flags for every EngineArgs field, named as vLLM names them (--max-num-seqs, -tp, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing

from roofline.config import EngineArgs

_SHORT = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"]}
_HELP = {
    "model": "HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "load_format": "auto | safetensors | gguf | dummy (random weights)",
    "quantized_weights": "native (quantized layers stay in their format and are computed on it: a GGUF file's "
                         "Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K blocks on the CPU, an FP8 block checkpoint's e4m3 "
                         "weights on the CPU and through Triton on CUDA) | dequantize (dense copies at load)",
    "gguf_weights": "the old name of --quantized-weights",
    "fp8_gemm": "CUDA route of FP8 block weights: auto (w8a8 where the GPU has FP8 units, sm_89+, else "
                "weight_only) | w8a8 (activations quantized per token and 128-column group, FP8 tensor cores) | "
                "weight_only (e4m3 weights expanded to the activations' dtype in the kernel)",
    "cpu_kernels": "the native C kernels for CPU layers (attention, GEMMs, norms, ...); --no-cpu-kernels runs "
                   "torch ops instead",
    "cpu_isa": "which build of the native CPU kernels to load: auto (the best this CPU runs) | avx512 | avx2 | "
               "neon | portable (plain C)",
    "cpu_layer_stack": "Llama-family models: a step's whole decoder stack in one native call (tp 1)",
    "cpu_greedy_head": "greedy rows' LM head through an int8 screen that computes only the candidates' fp32 "
                       "logits (the same token, bit for bit)",
    "cpu_moe_kernels": "MoE layers: native per-expert GEMMs on packed weights",
    "cpu_reuse_freed_memory": "have glibc keep freed activation buffers (up to 32 MiB) for reuse instead of "
                              "unmapping them (Linux)",
    "gguf_activations": "fp32 (native blocks times fp32 activations: exact) | q8 (activations quantized to 8 "
                        "bits per 32 values, as llama.cpp does, for integer dot products with Q4_0/Q4_1/Q8_0 "
                        "blocks: faster decode, close to fp32 but not equal)",
    "kv_cache_memory": "bytes for the KV pool on CPU",
    "hybrid_kv_cache": "models with sliding-window layers (Gemma 2/3, gpt-oss, Mistral v0.1, ...): those layers "
                       "get their own block tables from the one pool and give back the blocks that leave their "
                       "window (vLLM's hybrid allocator); --no-hybrid-kv-cache keeps every layer's blocks",
    "num_kv_blocks": "force the number of KV blocks (blocks of every layer: under the hybrid KV layout, whose "
                     "blocks hold a group's layers, the pool has as many more blocks as that memory holds)",
    "preemption_mode": "recompute | swap",
    "target_itl_ms": "inter-token latency target of a step that runs decodes, in ms: prefill chunks join the "
                     "decodes while the cost model (calibrated by measured steps) predicts the step within it, "
                     "at least a minimum chunk, at most --max-num-batched-tokens; a step without decodes gets "
                     "--max-num-batched-tokens. Unset: 1.25x the predicted decode step of the batch being built (the "
                     "running decodes and the requests that join them, as far as --max-num-seqs leaves seats) in "
                     "the server and the engine, off in the offline LLM class (throughput: no stream to protect); "
                     "0: off (--max-num-batched-tokens every step)",
    "scheduling_policy": "fcfs | priority",
    "attention_backend": "auto | torch | cpu | triton",
    "tensor_parallel_size": "ranks (processes, one device each) to split every layer over, across all nodes",
    "pipeline_parallel_size": "pipeline stages, each holding a slice of the layers (world = data x pipeline x "
                              "tensor parallel ranks); the last stage holds the final norm and LM head and samples",
    "pp_layer_partition": "layers per pipeline stage, e.g. \"16,14\" (default: an even split, the remainder to "
                          "the stages before the last)",
    "data_parallel_size": "data-parallel attention: replicas of the tensor-parallel group, each with its own "
                          "scheduler, requests and KV pool (new requests go to the least-loaded one); their MoE "
                          "layers run expert-parallel together with --enable-expert-parallel",
    "enable_expert_parallel": "MoE layers hold whole experts, spread over the data x tensor parallel ranks, "
                              "tokens sent to them and back (all-to-all)",
    "all2all_backend": "expert-parallel token exchange: all_to_all (all_to_all_single: each token to its "
                       "experts' ranks and back) | allgather_reducescatter (every rank sees every token)",
    "enable_eplb": "expert-parallel load balancing: replicate hot experts and move experts between ranks "
                   "while serving (needs --enable-expert-parallel)",
    "eplb_config": 'EPLB settings as JSON: {"window_size": 1000, "step_interval": 3000, '
                   '"num_redundant_experts": 0, "log_balancedness": false}',
    "enable_dbo": "dual-batch overlap: a step with enough tokens runs each MoE layer's expert-parallel exchange as "
                  "two micro-batches, one's all-to-all in flight while the other's experts compute (needs "
                  "--enable-expert-parallel and --all2all-backend all_to_all)",
    "dbo_decode_token_threshold": "DBO for steps of decodes alone with at least this many tokens (all DP ranks)",
    "dbo_prefill_token_threshold": "DBO for steps holding a prefill with at least this many tokens (all DP ranks)",
    "nnodes": "machines taking part (torchrun-style); each runs world_size/nnodes ranks",
    "node_rank": "this machine's index in [0, nnodes); node 0 runs the engine, others `roofline worker`",
    "master_addr": "address of node 0, where rank 0 hosts the rendezvous",
    "master_port": "rendezvous port on node 0 (a free one on one node; 29500 when unset with nnodes > 1)",
    "distributed_backend": "gloo | nccl for the model's collectives (gloo on CPU, nccl on CUDA when unset)",
    "distributed_executor_backend": "mp (worker processes started here; other nodes run `roofline worker`) | ray "
                                    "(one Ray actor per rank in a placement group, on the cluster at RAY_ADDRESS, or a "
                                    "new local Ray; needs the roofline[ray] extra)",
    "ray_placement_strategy": "with ray: the placement group's strategy, PACK | SPREAD | STRICT_PACK | STRICT_SPREAD",
    "ray_placement_timeout": "with ray: seconds to wait for the placement group before failing with what the "
                             "cluster has",
    "step_roofline": "live roofline: account each step's bytes and FLOPs against the device's bound "
                     "(/metrics roofline:step_*, /dashboard); --no-step-roofline turns the records off (the "
                     "token budget, --target-itl-ms, still measures each step against the bound)",
    "speculative_config": "speculative decoding as a JSON object, vLLM's keys: method (ngram | draft_model | mtp), "
                          "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, "
                          "draft_tensor_parallel_size; and adaptive (true: drafts per step from the cost model), "
                          "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'",
    "engine_core_process": "server: run the engine core (scheduler, executor, detokenizer) in a process of its "
                           "own, apart from HTTP and tokenization (msgpack over a socket pair); "
                           "--no-engine-core-process runs it in a thread of the server process",
    "roofline_hardware": "bandwidth/peak for the live roofline: a `roofline plan` preset (h100-sxm, h200, "
                         "a100-80gb, l4) or 'measure' (probe now, and refresh this machine's cached probes); unset: "
                         "the matching GPU preset, else this machine's probes, measured at its first start-up and "
                         "cached (~/.cache/roofline)",
    "enable_lora": "serve LoRA adapters (PEFT directories): a request picks one by name (the server's "
                   "\"model\", --lora-modules) or with a LoRARequest (offline); one step mixes rows of several "
                   "adapters and of the base model",
    "max_loras": "with --enable-lora, adapters in one step (each a slot in every adapted layer)",
    "max_lora_rank": "with --enable-lora, the largest adapter rank (the slots' width); higher ranks are refused",
    "max_cpu_loras": "with --enable-lora, adapters kept loaded on the CPU (least recently used leaves first; "
                     "at least --max-loras; default: --max-loras)",
    "kv_events_config": "KV-cache events for a router's prefix-aware scoring, vLLM's JSON: "
                        "{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": null, \"buffer_steps\": 10000, \"hwm\": 100000, \"topic\": \"\"}; "
                        "BlockStored / BlockRemoved / AllBlocksCleared batches as vLLM publishes them",
    "kv_transfer_config": "prefill/decode disaggregation, as JSON: {\"kv_connector\": \"SharedStorageConnector\" | "
                          "\"P2pConnector\", \"kv_role\": \"kv_producer\" | \"kv_consumer\" | \"kv_both\", "
                          "\"kv_ip\", \"kv_port\", \"kv_load_failure_policy\": \"recompute\" | \"fail\", "
                          "\"kv_connector_extra_config\": {...}}",
}


def _base_type(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def json_object(text: str) -> dict:
    """A command-line JSON object (e.g. --speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


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
            group.add_argument(*names, dest=f.name, type=json_object if tp is dict else tp, default=f.default,
                               help=help_text)


def engine_args_from(ns: argparse.Namespace, **overrides) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)}
    values.update(overrides)
    return EngineArgs(**values)
