"""How much of a CPU decode step a large vocabulary costs: the LM head's and the sampler's share.

Gemma 3 270M has 262,144 tokens (SmolLM2 49,152): its LM head is a (rows, 640) x (640, 262,144)
matmul each step, and the sampler reads a 1 MiB float32 row per sequence. The engine already
computes logits only for the rows that sample (``ModelRunner.execute_model`` selects them before
the head). This times whole decode steps and, inside them, the head and the sampler:

    python benchmarks/vocab_share.py [--model gemma-3-270m] [--batch 1 8] [--steps 16]

Timings are the machine's at the moment: other processes running at the same time slow them.
"""
from __future__ import annotations

import argparse
import time

import torch

from minipaged import LLM, SamplingParams


def measure(llm, batch: int, steps: int, prompt_len: int) -> dict:
    """Seconds per decode step: the whole step, the LM head (``compute_logits``), the sampler.

    Args:
        llm: the ``LLM`` (one worker in this process).
        batch: sequences decoding together.
        steps: decode steps timed, after the prompts and two warm-up steps.
        prompt_len: tokens per prompt.
    """
    engine = llm.llm_engine
    model = engine.worker.model
    spent = {"head": 0.0, "sample": 0.0}
    timing = [False]

    def timer(name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if timing[0]:
                spent[name] += time.perf_counter() - t0
            return out
        return timed

    sampler = engine.sampler
    model.compute_logits = timer("head", model.compute_logits)  # (an instance attribute)
    engine.sampler = timer("sample", sampler)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
        ids = min(1000, engine.hf_config.vocab_size - 10)  # ordinary tokens, past the specials
        for i in range(batch):
            prompt = [(7 * i + 11 * t) % ids + 10 for t in range(prompt_len)]
            engine.add_request(f"vocab-{batch}-{i}", None, params, prompt_token_ids=prompt)
        while engine.scheduler.waiting:
            engine.step()  # the prompts
        engine.step(), engine.step()  # warm-up decode steps
        timing[0] = True
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step = (time.perf_counter() - t0) / steps
        timing[0] = False
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del model.compute_logits  # the class's method again
        engine.sampler = sampler
    return {"step": step, "head": spent["head"] / steps, "sample": spent["sample"] / steps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per batch")
    parser.add_argument("--prompt-len", type=int, default=64)
    args = parser.parse_args(argv)
    llm = LLM(args.model, dtype="float32", device="cpu")
    vocab = llm.llm_engine.hf_config.vocab_size
    print(f"{args.model}: vocabulary {vocab:,}; torch threads {torch.get_num_threads()}")
    for batch in args.batch:
        m = measure(llm, batch, args.steps, args.prompt_len)
        logits = m["head"] + m["sample"]
        print(f"batch {batch}: decode step {1000 * m['step']:.1f} ms; LM head "
              f"{1000 * m['head']:.1f} ms + sampler {1000 * m['sample']:.1f} ms = "
              f"{100 * logits / m['step']:.0f} % of the step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
