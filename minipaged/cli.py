"""The command line.

    minipaged generate "prompt" [--model ...] [--max-tokens ...] [--stream]
    minipaged serve [MODEL] [--host 127.0.0.1] [--port 8000] [--num-gpu-blocks ...]
    minipaged demo
"""
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
    gen.add_argument("--stream", action="store_true",
                     help="print tokens as they are generated (all prompts run together)")
    sub.add_parser("demo", help="answer a few prompts with the embedded model and show stats")
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                                       "/v1/chat/completions, /metrics)")
    srv.add_argument("model", nargs="?", default=None,
                     help="HF id or local directory (default: embedded SmolLM2-135M-Instruct)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None,
                     help="the name clients pass as 'model' (default: the model argument)")
    srv.add_argument("--log-level", default="info")
    srv.add_argument("--device", default="auto")
    srv.add_argument("--seed", type=int, default=0)
    for flag, kind in ENGINE_FLAGS.items():
        srv.add_argument(flag, type=kind, default=None)
    args = parser.parse_args(argv)

    if args.command == "demo":
        from minipaged.demo import main as demo_main

        return demo_main()
    if args.command == "serve":
        return _serve(args)

    from minipaged import LLM, SamplingParams
    from minipaged.model_loader import is_embedded

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        llm = LLM(args.model, device=args.device, block_size=args.block_size)
        chat = args.chat if args.chat is not None else is_embedded(args.model)
        if args.stream:
            return _generate_streaming(llm, args.prompts, params, chat)
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


# `minipaged serve` flags that become LLMEngine keywords (dashes to underscores).
ENGINE_FLAGS = {"--dtype": str, "--tokenizer": str, "--block-size": int,
                "--num-gpu-blocks": int, "--num-cpu-blocks": int, "--kv-cache-bytes": int,
                "--swap-space": float, "--gpu-memory-utilization": float,
                "--max-num-seqs": int, "--max-num-batched-tokens": int, "--max-model-len": int,
                "--preemption-mode": str, "--watermark": float, "--load-format": str}


def _serve(args) -> int:
    from minipaged.async_engine import AsyncLLMEngine
    from minipaged.engine import LLMEngine
    from minipaged.model_loader import EMBEDDED_MODEL, is_embedded
    from minipaged.server import serve

    options = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
               for flag in ENGINE_FLAGS}
    options = {k: v for k, v in options.items() if v is not None}
    try:
        engine = LLMEngine(args.model, device=args.device, seed=args.seed, **options)
    except (ValueError, OSError) as e:
        print(f"minipaged: error: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or (EMBEDDED_MODEL if is_embedded(args.model) else args.model)
    print(f"minipaged: serving {name!r} on http://{args.host}:{args.port}/v1 "
          f"({engine.block_manager.num_total_gpu_blocks} KV blocks of {engine.block_size} tokens "
          f"on {engine.device})", flush=True)
    serve(AsyncLLMEngine(engine), name, args.host, args.port, args.log_level)
    return 0


def _generate_streaming(llm, prompts: list[str], params, chat: bool) -> int:
    """Print each prompt's tokens as they come, through the same path as the server's streams.

    All prompts run together; the first streams live, the others print as soon as their turn
    comes (by then they have usually finished)."""
    import asyncio

    from minipaged.async_engine import AsyncLLMEngine, PromptRequest, TextStreamer

    tokenizer = llm.get_tokenizer()
    requests = []
    for prompt in prompts:
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            requests.append(PromptRequest(text, params, ids))
        else:
            requests.append(PromptRequest(prompt, params))

    async def run() -> None:
        async_engine = AsyncLLMEngine(llm.llm_engine)
        async_engine.start()
        try:
            order = [async_engine.new_request_id("cli") for _ in prompts]
            outputs: asyncio.Queue = asyncio.Queue()
            await async_engine.add_requests(order, requests, outputs)
            pending: dict[str, list[str]] = {rid: [] for rid in order}
            streamers = {rid: TextStreamer(params.stop_strings) for rid in order}
            turn = 0
            print(f"### {prompts[0]}", flush=True)
            async for request_id, output in async_engine.stream_outputs(order, outputs):
                delta = streamers[request_id].update(output.outputs[0])[0]
                pending[request_id].append(delta)
                if output.finished:
                    pending[request_id].append(None)  # marks the end
                while turn < len(order):  # print what the current prompt's turn allows
                    pieces, pending[order[turn]] = pending[order[turn]], []
                    done = None in pieces
                    print("".join(p for p in pieces if p is not None), end="", flush=True)
                    if not done:
                        break
                    turn += 1
                    print("\n", flush=True)
                    if turn < len(order):
                        print(f"### {prompts[turn]}", flush=True)
        finally:
            async_engine.shutdown()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
