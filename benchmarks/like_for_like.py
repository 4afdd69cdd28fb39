"""The small engines' shared offline benchmark, run like for like, with its memory floor.

The best-known small engines publish one offline benchmark: 256 sequences drawn with Python's
``random.seed(0)``, each prompt ``randint(100, 1024)`` random token ids in ``[0, 10000]``, each
output ``randint(100, 1024)`` tokens, temperature 0.6, ``ignore_eos``, on Qwen3-0.6B with
``max_model_len=4096`` (142,827 prompt and 133,966 output tokens in all). This script draws the
same trace with the same calls in the same order, runs it through minipaged, and prints output
tokens/s next to the trace's **memory floor** on the machine it runs on: every weight byte read
once per decode step, and every cached K/V byte read once per decode step of its sequence, with
all sequences admitted at once, at the bandwidth of a device-to-device copy measured here.

    python benchmarks/like_for_like.py --device cuda --dtype bfloat16      # the GPU figure
    python benchmarks/like_for_like.py --dummy tiny-llama --num-seqs 8 \
        --max-input-len 64 --max-output-len 32                              # CPU, tests

``--dummy qwen3-0.6b`` is Qwen3-0.6B's shape (28 layers, hidden 1024, 16 query and 8 kv heads of
128, MLP 3072, vocabulary 151,936, tied embeddings) with random weights, as a LLaMA model: the
per-head q/k norms Qwen3 adds are a few hundred numbers per layer and change no byte count that
matters here. ``--model DIR`` runs a checkpoint instead. ``--record`` appends the result to
benchmarks/RESULTS.md with the date, the machine and the protocol.
"""
from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM, SamplingParams  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from machine import append_results, machine_description  # noqa: E402

SHAPES = {
    "qwen3-0.6b": dict(model_type="llama", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny-llama": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=10001, max_position_embeddings=4096),
}


def make_trace(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
               seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths), drawn as the small engines' benchmark draws them: the seed,
    then every prompt (its length, then its ids), then every output length."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))]
               for _ in range(num_seqs)]
    outputs = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, outputs


def floor_bytes(prompts: list[list[int]], outputs: list[int], weight_bytes: int,
                kv_bytes_per_token: int) -> int:
    """Bytes the trace must read at least: all weights once per decode step (as many steps as the
    longest output: every sequence is admitted at once), and each sequence's cached K/V once per
    token it generates (the context before token t of a prompt of p tokens is p + t)."""
    weights = max(outputs) * weight_bytes
    kv = sum(o * len(p) + o * (o - 1) // 2 for p, o in zip(prompts, outputs))
    return weights + kv * kv_bytes_per_token


def copy_bandwidth(device: torch.device, num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once), the
    best of ``repeats``; a tensor far larger than any cache."""
    n = num_bytes // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best


def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads: every parameter once, but the input embedding only
    when the output layer is the same tensor (tied: GPT-2 always, LLaMA-family models when the
    config says so); otherwise a step reads just a few rows of it."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = getattr(model, "embed_tokens", None)  # LLaMA-family; GPT-2's wte is tied
    if embedding is not None and not getattr(model, "tie_word_embeddings", False):
        total -= embedding.weight.numel() * embedding.weight.element_size()
    return total


def run(args) -> dict:
    from transformers import AutoConfig

    if args.model:
        model_dir, kwargs, name = args.model, {}, args.model
    else:
        shape = dict(SHAPES[args.dummy])
        config = AutoConfig.for_model(shape.pop("model_type"), **shape)
        config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
        model_dir = tempfile.mkdtemp(prefix="minipaged-like-for-like-")
        atexit.register(shutil.rmtree, model_dir, True)  # (only a config.json in it)
        config.save_pretrained(model_dir)
        kwargs, name = dict(load_format="dummy"), f"dummy {args.dummy}"
    prompts, outputs = make_trace(args.num_seqs, args.max_input_len, args.max_output_len,
                                  args.seed)
    llm = LLM(model_dir, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)), seed=args.seed,
              enforce_eager=args.enforce_eager, **kwargs)
    engine = llm.llm_engine
    device = engine.device
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o) for o in outputs]
    llm.generate(prompt_token_ids=[prompts[0][:16]], use_tqdm=False,
                 sampling_params=SamplingParams(temperature=0.6, max_tokens=4))  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    if generated != sum(outputs):
        raise SystemExit(f"minipaged generated {generated} tokens, the trace asks for "
                         f"{sum(outputs)}")
    shape = engine.model_shape
    weight_bytes = weight_bytes_per_step(engine.worker.model)
    kv_per_token = engine.block_bytes // engine.block_size  # all layers, K and V
    need = floor_bytes(prompts, outputs, weight_bytes, kv_per_token)
    bandwidth = copy_bandwidth(device, 1 << 30 if device.type == "cuda" else 1 << 28)
    floor_s = need / bandwidth
    result = dict(model=name, device=device, dtype=engine.dtype, seqs=len(prompts),
                  prompt_tokens=sum(map(len, prompts)), output_tokens=generated,
                  seconds=seconds, tok_s=generated / seconds, floor_s=floor_s,
                  floor_tok_s=generated / floor_s, bandwidth=bandwidth,
                  weight_bytes=weight_bytes, kv_per_token=kv_per_token,
                  steps=engine.stats.num_steps, layers=shape.num_layers,
                  preemptions=engine.stats.as_dict().get("num_preemptions", 0),
                  gpu_blocks=engine.block_manager.num_total_gpu_blocks)
    llm.shutdown()
    return result


def format_result(r: dict) -> str:
    return "\n".join([
        "| model | seqs | prompt tokens | output tokens | time (s) | output tok/s | floor (s) | "
        "floor tok/s | of the floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {r['model']}, {r['dtype']} | {r['seqs']} | {r['prompt_tokens']:,} | "
        f"{r['output_tokens']:,} | {r['seconds']:.2f} | {r['tok_s']:,.0f} | {r['floor_s']:.3f} | "
        f"{r['floor_tok_s']:,.0f} | {r['tok_s'] / r['floor_tok_s']:.1%} |",
        "",
        f"floor: {r['weight_bytes'] / 1e6:,.1f} MB of weights per decode step, "
        f"{r['kv_per_token']:,} bytes of K/V per token, read at {r['bandwidth'] / 1e9:,.1f} GB/s "
        f"(a device-to-device copy measured here); {r['steps']} engine steps, "
        f"{r['gpu_blocks']} KV blocks, {r['preemptions']} preemptions",
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a checkpoint directory instead of --dummy")
    ap.add_argument("--dummy", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0, help="the KV pool on the CPU")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    for name in ("max_input_len", "max_output_len"):
        if getattr(args, name) < 100:
            ap.error(f"--{name.replace('_', '-')} must be at least 100: the benchmark draws "
                     f"lengths from randint(100, it)")
    result = run(args)
    machine = machine_description(result["device"])
    table = format_result(result)
    print(f"{machine}\n\n{table}")
    if args.record:
        path = append_results(
            "Like for like: the small engines' offline benchmark",
            [f"machine: {machine}",
             f"protocol: `python benchmarks/like_for_like.py {' '.join(sys.argv[1:])}`; "
             f"random.seed({args.seed}), {args.num_seqs} sequences, prompts randint(100, "
             f"{args.max_input_len}) ids in [0, 10000], outputs randint(100, "
             f"{args.max_output_len}), temperature 0.6, ignore_eos, max_model_len "
             f"{args.max_model_len}; one warm-up request; the floor as the script's docstring "
             f"defines it"], args.note, table)
        print(f"recorded in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
