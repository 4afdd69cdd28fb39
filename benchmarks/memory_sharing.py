"""Memory saved by sharing KV blocks: parallel sampling and beam search (issue 3, lesson 03).

    python benchmarks/memory_sharing.py              # embedded SmolLM2-135M-Instruct, CPU
    python benchmarks/memory_sharing.py --record     # also write the table to RESULTS.md

The PagedAttention paper (section 6.3) counts the KV blocks that parallel sampling and beam
search need with block sharing and without it: 6-30 % fewer blocks for parallel sampling,
37-66 % fewer for beam search. We repeat the measurement: for each setting the same seeded
prompts run twice, and ``stats.peak_gpu_blocks_used`` (the most GPU blocks held at once) is
compared.

What "sharing disabled" means here (``lab.no_sharing.NoSharingBlockManager``): no sequence
ever holds a block another sequence holds, as in an engine that keeps one contiguous KV copy per
sample or beam. The prompt is still computed once: it is written into blocks shared for that
one step, and at the next step every sequence gets private copies (real data copies through
``blocks_to_copy``). Likewise a beam forked from another beam copies the parent's whole history
instead of sharing it. So both runs sample from the same logits and generate the same tokens
(the script checks this), and only the memory differs. As a cross-check the script also prints
the analytic no-sharing count: the sum over sequences of ceil(tokens in the cache / block size)
at the last step, which the measured no-sharing peak must equal when all requests run at once.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.core.block_manager import BlockSpaceManager  # noqa: E402
from minipaged.lab.no_sharing import NoSharingBlockManager  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from machine import machine_description  # noqa: E402

INSTRUCTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold.",
    "Give me five ideas for a rainy afternoon with children.",
    "Describe the water cycle to a ten-year-old.",
    "What are the pros and cons of working from home?",
    "Write a limerick about a cat that learns to code.",
    "Summarise the plot of a heist movie you would like to see.",
    "How do I make a good first impression at a job interview?",
    "Explain what a hash table is and when to use one.",
    "Plan a three-day trip to a city by the sea.",
    "Why is the sky blue? Answer in a few sentences.",
    "Write a polite email asking a neighbour to turn down their music.",
]
SECTION = "## Memory saved by sharing (issue 3)"


def make_prompts(tokenizer, num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    chosen = rng.sample(INSTRUCTIONS, num)
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False) for text in chosen]


def run(llm: LLM, prompts, params: SamplingParams, share: bool):
    engine = llm.llm_engine
    # A fresh manager each run: what one run's prefix cache named, the next run overwrites.
    manager_class = BlockSpaceManager if share else NoSharingBlockManager
    engine.scheduler.replace_block_manager(manager_class.like(engine.block_manager))
    engine.stats.reset()
    t0 = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    bm = engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks, "blocks leaked"
    assert engine.stats.num_preemptions_swap + engine.stats.num_preemptions_recompute == 0
    tokens = [[o.token_ids for o in r.outputs] for r in outputs]
    return engine.stats.peak_gpu_blocks_used, engine.stats.num_blocks_copied, tokens, elapsed


def analytic_no_sharing(prompts, width: int, max_tokens: int, block_size: int) -> int:
    """Every sequence holds its own blocks for all tokens in the cache at the last step (the
    last sampled token is never written), all requests at once."""
    return sum(width * math.ceil((len(p) + max_tokens - 1) / block_size) for p in prompts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true",
                    help="write the table into benchmarks/RESULTS.md (replacing this section)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    llm = LLM(block_size=args.block_size, seed=args.seed)  # the embedded SmolLM2-135M-Instruct
    prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, args.seed)
    print(f"{len(prompts)} prompts of {[len(p) for p in prompts]} tokens, "
          f"{args.max_tokens} new tokens each (ignore_eos), block size {args.block_size}; "
          f"model loaded in {time.perf_counter() - t0:.1f} s")

    rows = []
    for kind in ("parallel sampling", "beam search"):
        for width in args.widths:
            if kind == "beam search":
                params = SamplingParams(n=width, use_beam_search=True, temperature=0.0,
                                        max_tokens=args.max_tokens, ignore_eos=True)
            else:
                params = SamplingParams(n=width, temperature=args.temperature, seed=args.seed,
                                        max_tokens=args.max_tokens, ignore_eos=True)
            shared, copies_shared, tokens_shared, t_shared = run(llm, prompts, params, True)
            private, copies_private, tokens_private, t_private = run(llm, prompts, params, False)
            if tokens_shared != tokens_private:
                raise SystemExit(f"{kind} width {width}: the runs generated different tokens")
            analytic = analytic_no_sharing(prompts, width, args.max_tokens, args.block_size)
            saving = 100.0 * (private - shared) / private
            rows.append((kind, width, shared, private, analytic, saving, copies_shared,
                         copies_private))
            print(f"{kind:17s} {width}: sharing {shared:4d} blocks, no sharing {private:4d} "
                  f"(analytic {analytic}), saving {saving:5.1f} %; block copies "
                  f"{copies_shared} / {copies_private}; {t_shared + t_private:.1f} s")

    table = ("| setting | width | peak blocks, sharing | peak blocks, no sharing | "
             "analytic no sharing | saving | blocks copied (sharing / no sharing) |\n"
             "|---|---|---|---|---|---|---|\n")
    for kind, width, shared, private, analytic, saving, c_s, c_p in rows:
        what = f"n = {width}" if kind == "parallel sampling" else f"beam width {width}"
        table += (f"| {kind} | {what} | {shared} | {private} | {analytic} | {saving:.1f} % | "
                  f"{c_s} / {c_p} |\n")
    print()
    print(table)
    if args.record:
        record(table, args, prompts, time.perf_counter() - t0)
    return 0


def record(table: str, args, prompts, total_s: float) -> None:
    import transformers

    today = datetime.date.today().isoformat()
    section = (
        f"{SECTION}\n\n"
        f"- date: {today}; machine: {machine_description()}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}\n"
        f"- model: embedded SmolLM2-135M-Instruct (float32); {len(prompts)} chat prompts "
        f"(seed {args.seed}) of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"{args.max_tokens} new tokens each (ignore_eos), all requests at once, block size "
        f"{args.block_size}; parallel sampling at temperature {args.temperature}, beam search "
        f"greedy; the whole run took {total_s:.0f} s\n"
        f"- command: `python benchmarks/memory_sharing.py {' '.join(sys.argv[1:])}`\n"
        f"- \"no sharing\": every sequence holds private copies of all its blocks from the step "
        f"after its prompt is computed or its beam is forked (real copies through "
        f"`blocks_to_copy`, `NoSharingBlockManager`); both runs generate the "
        f"same tokens (checked). \"analytic\" is the sum over sequences of ceil(cached tokens / "
        f"block size) at the last step.\n"
        f"- the paper (PagedAttention, section 6.3) reports 6-30 % for parallel sampling and "
        f"37-66 % for beam search, on OPT-13B with Alpaca/ShareGPT traces; the saving grows "
        f"with the share of tokens in common: the prompt (parallel sampling), and for beam "
        f"search also the history the beams have in common.\n\n"
        f"{table}")
    path = os.path.join(os.path.dirname(__file__), "RESULTS.md")
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n"
    start = text.find(SECTION)
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        rest = "" if end == -1 else text[end:]
        text = text[:start] + section.rstrip("\n") + "\n" + rest
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    print(f"recorded in {path}")


if __name__ == "__main__":
    raise SystemExit(main())
