"""Multi-LoRA serving: PEFT adapters applied per request, several adapters and the base model mixed in one
step.

    request.py   LoRARequest (which adapter a request runs under; msgspec, it travels to the workers)
    peft.py      reading a PEFT adapter directory, every config field honoured or refused
    mapping.py   our linear layers an adapter may target, PEFT's module names mapped onto them (fused
                 qkv / gate_up slices, tensor-parallel shards), the engine's AdapterValidator
    layers.py    LoRALayer (the slots of one linear layer and its delta) and StepBatch (the step's rows by
                 adapter)
    manager.py   the worker's slot manager: loaded adapters (LRU), slots, the step's batch
    ops.py       the grouped shrink/expand implementations

The engine checks an adapter before a request runs under it; the scheduler keeps at most max_loras adapters
running; the prefix cache keys blocks by adapter (core/kv_cache_manager.py); the model runner describes each
step's rows by adapter once; each LoRA layer adds its delta to its base product.
"""
