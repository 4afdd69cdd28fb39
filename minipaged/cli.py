"""The command line: ``minipaged generate "prompt" [--model ...] [--max-tokens ...]``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minipaged", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text (one or more)")
    gen.add_argument("--model", default=None,
                     help="HF id or local directory (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="auto")
    gen.add_argument("--block-size", type=int, default=16)
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="format each prompt as a user message with the chat template "
                          "(default: on for the embedded instruct model)")
    sub.add_parser("demo", help="answer a few prompts with the embedded model and show stats")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from minipaged.demo import main as demo_main

        return demo_main()

    from minipaged import LLM, SamplingParams
    from minipaged.model_loader import is_embedded

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        llm = LLM(args.model, device=args.device, block_size=args.block_size)
        chat = args.chat if args.chat is not None else is_embedded(args.model)
        if chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts],
                               params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except ValueError as e:
        print(f"minipaged: error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
