"""llama.cpp as W5's benchmark peer: batch-1 greedy decode of a GGUF file through llama-cpp-python.

Run by another interpreter (a virtual environment with `llama-cpp-python` installed; it is a peer, not
a dependency of roofline), with the standard library and llama_cpp only:

    python llamacpp_peer.py MODEL.gguf THREADS N_OUT PROMPT_IDS_JSON

prints one JSON object: the prompt's prefill time (to the first token) and tokens/s, the decode TPOT and
tokens/s over the N_OUT greedy tokens (between the first and the last) as llama-cpp-python's generate
gives them, and llama.cpp's decode alone (N_OUT single-token evals, no sampling: its best case).
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    import llama_cpp

    model, threads, n_out, prompt = argv[0], int(argv[1]), int(argv[2]), json.loads(argv[3])
    llm = llama_cpp.Llama(model_path=model, n_ctx=len(prompt) + n_out + 8, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, verbose=False, logits_all=False)
    # warm-up: a short prompt and a few tokens (page in the weights, build the thread pool)
    for i, _ in enumerate(llm.generate(prompt[:16][::-1], top_k=1, temp=0.0, reset=True)):
        if i >= 4:
            break
    llm.reset()
    stamps = []
    t0 = time.perf_counter()
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # the first token comes out of the prefill
        stamps.append(time.perf_counter())
        if len(stamps) >= n_out:
            break
    t_prefill, n = stamps[0] - t0, len(stamps)
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    # llama.cpp's decode alone (no sampling in Python): the prompt again, then n_out single-token evals
    llm.reset()
    llm.eval(prompt)
    t1 = time.perf_counter()
    for i in range(n_out):
        llm.eval([prompt[i % len(prompt)]])
    eval_tpot = (time.perf_counter() - t1) / n_out
    print(json.dumps({"peer": f"llama-cpp-python {llama_cpp.__version__}", "threads": threads,
                      "prompt_tokens": len(prompt), "prefill_s": t_prefill, "prefill_tok_s": len(prompt) / t_prefill,
                      "output_tokens": n, "tpot_ms": 1000 * tpot, "decode_tok_s": 1 / tpot,
                      "eval_only_tpot_ms": 1000 * eval_tpot, "eval_only_tok_s": 1 / eval_tpot}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
