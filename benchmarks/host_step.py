"""The engine's own work in a decode step: everything but the model (lesson 15).

On a GPU the model of a big batch is one CUDA-graph replay, and what the host does around it
(scheduling, preparing the flat batch, sampling, applying the tokens) is time the GPU waits: on
an H200 about 1.9 ms of a 10.2 ms LLaMA-7B step of 64 sequences (benchmarks/RESULTS.md). That
host work does not depend on the model's size, so here the model is as small as can be (one
layer, hidden size 64) and the rest is what a big model's step carries: a 32,000-token
vocabulary for the sampler, and batches of 16 to 256 greedy sequences of 128-token prompts.

    python benchmarks/host_step.py [--batches 16 64 256] [--steps 20] [--vocab 32000]
                                   [--num-scheduler-steps 1]

It prints one row per batch: each section's mean milliseconds per decode step
(``lab/step_breakdown``, each section closed by a synchronisation), and the host's share per
sequence. With ``--num-scheduler-steps k`` (multi-step decode, ``engine/multi_step.py``) each
timed ``step()`` runs k decode steps from one schedule, and the times are divided by the decode
steps run: what the host spends per token when k tokens share a schedule.
"""
from __future__ import annotations

import argparse
import sys
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_description  # noqa: E402

from minipaged import LLM  # noqa: E402
from minipaged.lab.step_breakdown import decode_step_breakdown  # noqa: E402

SECTIONS = ("schedule", "prepare", "model", "sample", "update", "python", "step")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per batch")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady)")
    ap.add_argument("--num-scheduler-steps", type=int, default=1,
                    help="multi-step decode: decode steps per schedule (1: off)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, vocab_size=args.vocab,
                         max_position_embeddings=4096, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)
    k = args.num_scheduler_steps
    # room for the prompt, its first token, k per step() (a warm-up and the timed ones), and some
    # about --steps decode steps whatever k, so that k = 1 and k = 8 time the same contexts
    calls = max(1, -(-args.steps // k))
    max_len = args.prompt_len + k * (calls + 1) + args.steps + 16
    print(f"# host work of a decode step, {date.today()}, {machine_description()}")
    what = ("step" if k == 1 else
            f"decode step, num_scheduler_steps={k} ({calls} step() calls)")
    print(f"# 1-layer LLaMA of hidden size 64, vocabulary {args.vocab}, greedy, "
          f"{args.prompt_len}-token prompts, mean ms per {what}\n")
    print("| batch | " + " | ".join(SECTIONS) + " | host us / sequence |")
    print("|---:|" + "---:|" * (len(SECTIONS) + 1))
    for batch in args.batches:
        llm = LLM(None, hf_config=config, load_format="dummy", dtype="float32", device="cpu",
                  max_num_seqs=batch, max_model_len=max_len,
                  num_gpu_blocks=batch * -(-max_len // 16), num_cpu_blocks=0,
                  num_scheduler_steps=k)
        prompts = [[(7 * i + j) % (args.vocab - 100) + 100 for j in range(args.prompt_len)]
                   for i in range(batch)]
        b = decode_step_breakdown(llm, prompts, num_steps=calls)
        if b["decode_steps"] != k * calls:
            print(f"# batch {batch}: the {calls} timed calls ran {b['decode_steps']} decode "
                  f"steps, not {k * calls}")
        host = b["step"] - b["model"]
        print(f"| {batch} | " + " | ".join(f"{1e3 * b[k]:.2f}" for k in SECTIONS)
              + f" | {1e6 * host / batch:.1f} |", flush=True)
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
