"""One decode step at batch 64 under torch.profiler: where a GPU step's time goes (lesson 15).

Stage 6 of ``scripts/gpu_check.sh``. A LLaMA-7B-shaped model with dummy weights (no model hub
needed), fp16, eager (``enforce_eager=True``: a CUDA graph replay would hide the kernels from the
profiler), 64 sequences of 512-token prompts. Prints the step's time next to the floor set by
reading every weight once at the measured device-to-device copy bandwidth, and the top 20 ops by
GPU time. With ``$OUT`` set, the Chrome trace is written to ``$OUT/profile_decode.json``.

    python3 scripts/profile_decode.py [--batch 64] [--prompt-len 512] [--layers 32]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM, SamplingParams  # noqa: E402


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32, help="LLaMA-7B has 32")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_decode.py: needs a CUDA GPU")
        return 1
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4096, intermediate_size=11008,
                         num_hidden_layers=args.layers, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    bandwidth = copy_bandwidth()
    max_len = args.prompt_len + 16
    blocks = args.batch * -(-max_len // 16)
    llm = LLM(None, hf_config=config, load_format="dummy", dtype="float16", device="cuda",
              max_num_seqs=args.batch, max_model_len=max_len, num_gpu_blocks=blocks,
              num_cpu_blocks=0, enforce_eager=True)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), None, params,
                           prompt_token_ids=[(7 * i + j) % 31000 + 100
                                             for j in range(args.prompt_len)])
    while engine.scheduler.waiting:
        engine.step()  # the prompts
    for _ in range(2):
        engine.step()  # warm-up decode steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.step()
    torch.cuda.synchronize()
    step = time.perf_counter() - t0
    weights = engine.worker.memory_per_rank()[0]["weights"]
    floor = weights / (bandwidth / 2)  # reading only: half of the copy's read + write
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s (read + write); "
          f"decode step of {args.batch} sequences at ~{args.prompt_len} tokens: "
          f"{1e3 * step:.2f} ms; reading the {weights / 1e9:.1f} GB of weights once takes "
          f"{1e3 * floor:.2f} ms: {step / floor:.1f}x the floor", flush=True)

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=20))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "profile_decode.json")
        prof.export_chrome_trace(path)
        print(f"Chrome trace: {path}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
