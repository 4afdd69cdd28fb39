"""The command line.

    minipaged generate "prompt" [--model ...] [--max-tokens ...] [--stream] [--trace FILE]
                       [engine options]
    minipaged serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [limits]
                    [engine options]
    minipaged demo [--model gemma-3-270m] [--weights auto|gguf|float32]

Every engine setting (a field of EngineConfig, minipaged/config.py) is a flag of both `generate`
and `serve`, for example --num-gpu-blocks 64, --tensor-parallel-size 3,
--no-enable-prefix-caching, --trace steps.json (the steps for Perfetto).
"""
from __future__ import annotations

import argparse
import sys
import textwrap
import typing
from dataclasses import fields

from minipaged.config import EngineConfig


# Every engine setting is a flag of both `generate` and `serve` (the field's name with dashes),
# read from EngineConfig's fields: type, default and help. A bool becomes --flag / --no-flag. A
# flag left out is not passed, so the engine's default applies. These fields are no flags:
NOT_FLAGS = {
    "model": "`generate --model`, `serve MODEL`",
    "hf_config": "a transformers object",
    "speculative_config": "--speculative-config JSON and its fields' flags, below",
}


# Shorter names some settings' flags also answer to.
FLAG_ALIASES = {"trace_path": "--trace"}


def engine_options() -> list[tuple[str, type, str, object, tuple | None]]:
    """(name, type, help, default, choices) of every engine setting that is a flag."""
    hints = typing.get_type_hints(EngineConfig)
    options = []
    for f in fields(EngineConfig):
        if f.name in NOT_FLAGS:
            continue
        kinds = [k for k in typing.get_args(hints[f.name]) or (hints[f.name],)
                 if k is not type(None)]
        kind = kinds[0] if len(kinds) == 1 and kinds[0] in (bool, int, float) else str
        options.append((f.name, kind, f.metadata["help"], f.default, f.metadata.get("choices")))
    return options


# The server's limits on one request, as flags of `serve` (ServerLimits' fields with dashes):
# (field, help). A flag left out keeps ServerLimits' default.
LIMIT_OPTIONS = [
    ("max_body_bytes", "largest request body; a larger one gets 413 before it is read"),
    ("max_prompt_chars", "most characters of prompt text in one request (default: "
                         "max_model_len times the tokenizer's longest token)"),
    ("max_stop_strings", "most stop strings in one request"),
    ("max_stop_chars", "most characters of one stop string"),
    ("max_n", "largest n and best_of"),
    ("max_logprobs", "largest logprobs / top_logprobs"),
    ("max_waiting_requests", "most requests waiting to run; more get 503 with Retry-After "
                             "(default: 4 x max_num_seqs)"),
]


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine settings' flags, in their own group, with their defaults in the help."""
    group = parser.add_argument_group("engine options (as LLM(...) keywords)")
    for name, kind, help_text, default, choices in engine_options():
        if default is not None:
            help_text += f" (default: {default})"
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            aliases = [FLAG_ALIASES[name]] if name in FLAG_ALIASES else []
            group.add_argument(flag, *aliases, type=kind, default=None, choices=choices,
                               help=help_text)
    add_speculative_options(parser)


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """The flags that make `serve` safe to expose: the API key and LIMIT_OPTIONS."""
    from minipaged.entrypoints.limits import ServerLimits

    group = parser.add_argument_group("exposing the server (see the README's 'Serving')")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every /v1 route and "
                            "/metrics (default: $MINIPAGED_API_KEY, else no key)")
    group.add_argument("--metrics-public", action="store_true",
                       help="leave /metrics open without the key")
    group.add_argument("--no-live-page", action="store_true",
                       help="serve no live page at / (nor its event stream)")
    group.add_argument("--live-show-text", action="store_true",
                       help="the live page shows every request's text; by default only token "
                            "counts and block ownership (other people's chats stay theirs)")
    group.add_argument("--max-live-streams", type=int, default=None,
                       help="most live pages open at once (default: 4); one more gets 503")
    for name, help_text in LIMIT_OPTIONS:
        default = getattr(ServerLimits(), name)
        if default is not None:
            help_text += f" (default: {default})"
        group.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                           help=help_text)


def server_options(args):
    """The ``ServerOptions`` of `serve`'s flags (the key from $MINIPAGED_API_KEY if not given)."""
    import os

    from minipaged.entrypoints.api_server import ServerOptions
    from minipaged.entrypoints.limits import ServerLimits
    from minipaged.entrypoints.live_feed import LiveOptions

    limits = ServerLimits(**{name: getattr(args, name) for name, _ in LIMIT_OPTIONS
                             if getattr(args, name) is not None})
    api_key = args.api_key if args.api_key is not None else os.environ.get("MINIPAGED_API_KEY")
    streams = {} if args.max_live_streams is None else {"max_streams": args.max_live_streams}
    live = None if args.no_live_page else LiveOptions(show_text=args.live_show_text, **streams)
    return ServerOptions(api_key or None, args.metrics_public, limits, live)


# Speculative decoding (lesson 12): vLLM's --speculative-config JSON, or its fields as flags
# (a flag wins over the same key of the JSON): (flag's keyword, config key, type, help).
SPECULATIVE_OPTIONS = [
    ("speculative_method", "method", str, "ngram or draft (draft when a model is given)"),
    ("speculative_model", "model", str, "the draft model: a smaller model, same vocabulary"),
    ("num_speculative_tokens", "num_speculative_tokens", int, "k: tokens proposed per step"),
    ("prompt_lookup_max", "prompt_lookup_max", int, "ngram: longest n-gram looked up"),
    ("prompt_lookup_min", "prompt_lookup_min", int, "ngram: shortest n-gram looked up"),
]


def add_speculative_options(parser: argparse.ArgumentParser) -> None:
    """--speculative-config and the SPECULATIVE_OPTIONS flags, in their own group."""
    group = parser.add_argument_group("speculative decoding (lesson 12; off by default)")
    group.add_argument("--speculative-config", default=None,
                       help='vLLM\'s JSON, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4, "prompt_lookup_max": 3}\'')
    for name, _, kind, help_text in SPECULATIVE_OPTIONS:
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                           help=help_text)


def speculative_config(args) -> dict | None:
    """The ``speculative_config`` the flags give, or None (checked by the engine)."""
    import json

    config = {}
    if args.speculative_config is not None:
        try:
            config = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from e
        if not isinstance(config, dict):
            raise ValueError("--speculative-config must be a JSON object")
    for name, key, _, _ in SPECULATIVE_OPTIONS:
        if getattr(args, name) is not None:
            config[key] = getattr(args, name)
    return config or None


def engine_kwargs(args) -> dict:
    """The engine options given on the command line, as LLMEngine keywords."""
    kwargs = {name: getattr(args, name) for name, *_ in engine_options()
              if getattr(args, name) is not None}
    spec = speculative_config(args)
    if spec is not None:
        kwargs["speculative_config"] = spec
    return kwargs


class _WholeWords(argparse.HelpFormatter):
    """Help lines wrapped between words only: a file name such as ``.perfetto-trace`` is never
    cut at its hyphen."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minipaged", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts",
                         formatter_class=_WholeWords)
    gen.add_argument("prompts", nargs="+", help="prompt text (one or more)")
    gen.add_argument("--model", default=None,
                     help="HF id or local directory (default: embedded SmolLM2-135M-Instruct)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most new tokens per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    gen.add_argument("--top-k", type=int, default=-1, help="keep the k likeliest tokens (-1: all)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="format each prompt as a user message with the chat template "
                          "(default: on for the embedded model and gemma-3-270m)")
    gen.add_argument("--stream", action="store_true",
                     help="print tokens as they are generated (all prompts run together)")
    add_engine_options(gen)
    demo = sub.add_parser("demo", help="answer a few prompts with the embedded model and show "
                                       "stats")
    demo.add_argument("--model", default=None,
                      help="a chat model (default: embedded SmolLM2-135M-Instruct; "
                           "gemma-3-270m once its package is installed)")
    demo.add_argument("--weights", default="auto", choices=("auto", "gguf", "float32"),
                      help="how a packaged model's weights are held: its GGUF blocks as stored "
                           "(quantization='gguf') or float32; auto: gguf where no GPU is present "
                           "(measured faster there, the same greedy tokens)")
    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                                       "/v1/chat/completions, /metrics)",
                         formatter_class=_WholeWords)
    srv.add_argument("model", nargs="?", default=None,
                     help="HF id or local directory (default: embedded SmolLM2-135M-Instruct)")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to listen on (127.0.0.1: this machine only; 0.0.0.0 lets "
                          "every network in: give an --api-key)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on")
    srv.add_argument("--served-model-name", default=None,
                     help="the name clients pass as 'model' (default: the model argument)")
    srv.add_argument("--log-level", default="info", help="uvicorn's log level")
    srv.add_argument("--learner", action="store_true",
                     help="serve the engine built from your saved build-track components, as "
                          "lesson 16's capstone builds it; names every part still the package's")
    add_server_options(srv)
    add_engine_options(srv)
    args = parser.parse_args(argv)

    if args.command == "demo":
        from minipaged.entrypoints.demo import main as demo_main

        try:
            return demo_main(args.model, args.weights)
        except (ValueError, OSError) as e:
            print(f"minipaged: error: {e}", file=sys.stderr)
            return 2
    if args.command == "serve":
        return _serve(args)

    from minipaged.entrypoints.llm import LLM
    from minipaged.sampling_params import SamplingParams
    from minipaged.worker.checkpoint import is_packaged

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k)
        llm = LLM(args.model, **engine_kwargs(args))
        chat = args.chat if args.chat is not None else is_packaged(args.model)
        if args.stream:
            code = _generate_streaming(llm, args.prompts, params, chat)
            llm.shutdown()  # (closes a --trace file)
            return code
        if chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts],
                               params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
        llm.shutdown()  # (closes a --trace file)
    except (ValueError, OSError) as e:
        print(f"minipaged: error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs):
        print(f"### {prompt}\n{out.outputs[0].text}\n")
    return 0


def _serve(args) -> int:
    from minipaged.engine.llm_engine import LLMEngine

    if args.learner:
        import importlib

        # NOTE: found by name: the build track (exercises/) sits above the entrypoints
        # (docs/ARCHITECTURE.md); it builds the engine from the learner's components and comes
        # back to run_server
        return importlib.import_module(LEARNER_MODULE).serve(args)
    try:
        options = server_options(args)  # (first: a bad limit is refused before the model loads)
        engine = LLMEngine(args.model, **engine_kwargs(args))
    except (ValueError, OSError) as e:
        print(f"minipaged: error: {e}", file=sys.stderr)
        return 2
    return run_server(args, options, engine)


LEARNER_MODULE = "minipaged.exercises.served_learner"


def run_server(args, options, engine) -> int:
    """Serve ``engine`` with the server's ``options`` until interrupted."""
    from minipaged.engine.async_llm_engine import AsyncLLMEngine
    from minipaged.entrypoints.api_server import serve
    from minipaged.worker.checkpoint import EMBEDDED_MODEL, is_embedded

    name = args.served_model_name or (EMBEDDED_MODEL if is_embedded(args.model) else args.model)
    page = "" if options.live is None else f" (the live page: http://{args.host}:{args.port}/)"
    print(f"minipaged: serving {name!r} on http://{args.host}:{args.port}/v1{page} "
          f"({engine.block_manager.num_total_gpu_blocks} KV blocks of {engine.block_size} tokens "
          f"on {engine.device}; API key {'required' if options.api_key else 'not required'})",
          flush=True)
    if options.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"minipaged: warning: listening on {args.host} without --api-key: anyone who can "
              f"reach this port can use the engine", file=sys.stderr, flush=True)
    serve(AsyncLLMEngine(engine), name, args.host, args.port, args.log_level, options)
    return 0


def _generate_streaming(llm, prompts: list[str], params, chat: bool) -> int:
    """Print each prompt's tokens as they come, through the same path as the server's streams.

    All prompts run together; the first streams live, the others print as soon as their turn
    comes (by then they have usually finished)."""
    import asyncio

    from minipaged.engine.async_llm_engine import AsyncLLMEngine, PromptRequest, TextStreamer

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

    # NOTE: the engine's own request ids, as LLM.generate takes them: a request without a seed
    # is seeded from the engine's seed and its id, so --stream samples the same text.
    order = [llm.llm_engine.new_request_id() for _ in prompts]

    async def run() -> None:
        async_engine = AsyncLLMEngine(llm.llm_engine)
        async_engine.start()
        try:
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
