"""The CPU fast path's kernels in one place: the native C kernels (cpu_kernels.c, quant_kernels.c), their
build per instruction set and loading (ops.py), packed GEMM weights (gemm.py), GGUF blocks computed
natively (gguf_quant.py) and the greedy LM head's int8 screen (greedy_head.py).  Model code reaches them
through its layers (linear, vocab_embedding, attention's cpu backend, the MoE experts, the Llama layer
stack); which of them run is EngineConfig's to say (worker.apply_cpu_settings)."""
