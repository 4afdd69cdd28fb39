"""One decode step at batch 64 under torch.profiler: where a GPU step's time goes (lesson 15).

Stage 6 of ``scripts/gpu_check.sh``. A LLaMA-7B-shaped model with dummy weights (no model hub
needed), fp16, eager (``enforce_eager=True``: a CUDA graph replay would hide the kernels from the
profiler), 64 sequences of 512-token prompts. Prints the step's time next to the floor set by
reading every weight once at the measured device-to-device copy bandwidth, and the top 20 ops by
GPU time. With ``$OUT`` set, the Chrome trace is written to ``$OUT/profile_decode.json``.

    python3 scripts/profile_decode.py [--batch 64] [--prompt-len 512] [--layers 32]

``--device cpu --hidden 256 --layers 1 --batch 2 --prompt-len 16`` (float32) runs the same code
on a CPU, small: how the script itself is tested (tests/entrypoints/test_gpu_check_script.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM, SamplingParams  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, num_bytes: int = 1 << 30) -> float:
    """Bytes/s of a copy within the device's memory, counting the read and the write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32, help="LLaMA-7B has 32")
    ap.add_argument("--hidden", type=int, default=4096, help="LLaMA-7B's; heads of 128")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("profile_decode.py: needs a CUDA GPU (or --device cpu, to try the script)")
        return 1
    from transformers import LlamaConfig

    heads = args.hidden // 128
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=11008 * args.hidden // 4096,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=heads, vocab_size=32000, max_position_embeddings=2048,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    bandwidth = copy_bandwidth(device, (1 << 30) if device == "cuda" else (1 << 26))
    max_len = args.prompt_len + 16
    blocks = args.batch * -(-max_len // 16)
    dtype = "float16" if device == "cuda" else "float32"
    llm = LLM(None, hf_config=config, load_format="dummy", dtype=dtype, device=device,
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
    sync(device)
    t0 = time.perf_counter()
    engine.step()
    sync(device)
    step = time.perf_counter() - t0
    weights = engine.worker.memory_per_rank()[0]["weights"]
    floor = weights / (bandwidth / 2)  # reading only: half of the copy's read + write
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{name}: copy {bandwidth / 1e12:.2f} TB/s (read + write); "
          f"decode step of {args.batch} sequences at ~{args.prompt_len} tokens: "
          f"{1e3 * step:.2f} ms; reading the {weights / 1e9:.1f} GB of weights once takes "
          f"{1e3 * floor:.2f} ms: {step / floor:.1f}x the floor", flush=True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        engine.step()
        sync(device)
    sort_by = "device_time_total" if device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=20))
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "profile_decode.json")
        prof.export_chrome_trace(path)
        print(f"Chrome trace: {path}")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
