"""`roofline generate`: run the engine offline on prompts from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from roofline.entrypoints.engine_flags import add_engine_args, engine_args_from


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text offline for one or more prompts")
    p.add_argument("prompts", nargs="*", help="prompt texts (default: read one prompt per line from stdin)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from roofline import SamplingParams
    from roofline.engine.llm import LLM

    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("no prompt given", file=sys.stderr)
        return 2
    ea = engine_args_from(args)
    llm = LLM(**{k: v for k, v in vars(ea).items()})
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": c.text, "finish_reason": c.finish_reason,
                              "num_tokens": len(c.token_ids)}))
        else:
            print(f"### {prompt}\n{c.text}\n[{c.finish_reason}, {len(c.token_ids)} tokens]\n")
    llm.llm_engine.shutdown()  # worker processes stop here: the console script ends the process at once
    return 0
