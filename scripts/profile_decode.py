"""One decode step at batch 64: where a GPU step's time goes, against its floor (lesson 15).

Stage 5 of ``scripts/gpu_check.sh``. A LLaMA-7B-shaped model with dummy weights (no model hub
needed), fp16, 64 sequences of 128-token prompts (``--prompt-len``). It prints

1. the floor: reading every weight once, and every cached key and value once, at the memory
   bandwidth measured here (a device-to-device copy's bytes read + written per second);
2. the engine's decode step with CUDA graphs (as it serves), the median of ``--steps`` steps,
   each closed by a synchronisation, as a multiple of the weight-read floor and of the whole floor;
3. the same steps by section (``lab/step_breakdown.py``: schedule, prepare, the model's one graph
   replay, sample, update; each section closed by a synchronisation), and the q/k/v and gate/up
   projections of one layer as one matmul each (as the model runs them) against one by one;
4. multi-step decode (``num_scheduler_steps``, ``engine/multi_step.py``): the same model built
   with ``--multi-steps`` k, so that one schedule runs k greedy decode steps and the host's work
   overlaps the graph replays; its time per decode step (each ``step()`` timed as above, divided
   by the decode steps it ran) next to the single step's, and as a multiple of the weight floor;
5. an eager step under torch.profiler (a graph replay would hide the kernels from it): the top 20
   ops by GPU time. With ``$OUT`` set, its Chrome trace goes to ``$OUT/profile_decode.json``.

    python3 scripts/profile_decode.py [--batch 64] [--prompt-len 128] [--layers 32] [--steps 8]
                                      [--multi-steps 8]

``--device cpu --hidden 256 --layers 1 --batch 2 --prompt-len 16`` (float32) runs the same code
on a CPU, small: how the script itself is tested (tests/entrypoints/test_gpu_check_script.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.lab.step_breakdown import decode_step_breakdown  # noqa: E402
from minipaged.model_shape import ModelShape, kv_bytes_per_token  # noqa: E402


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


def multi_step_calls(args) -> int:
    """step() calls timed with multi-step decode: about ``--steps`` decode steps, at least 3."""
    return max(3, -(-args.steps // args.multi_steps))


def build(config, args, eager: bool, num_scheduler_steps: int = 1):
    # Every engine gets the same max_model_len (it sizes the graphs' attention launch), with room
    # for the multi-step engine's prompt token and k tokens per call: a warm-up and the timed.
    room = 1 + args.multi_steps * (1 + multi_step_calls(args)) if args.multi_steps > 1 else 0
    max_len = args.prompt_len + max(args.steps, room) + 16
    blocks = args.batch * -(-max_len // 16)
    dtype = "float16" if args.device == "cuda" else "float32"
    return LLM(None, hf_config=config, load_format="dummy", dtype=dtype, device=args.device,
               max_num_seqs=args.batch, max_model_len=max_len, num_gpu_blocks=blocks,
               num_cpu_blocks=0, enforce_eager=eager, num_scheduler_steps=num_scheduler_steps)


def fill(engine, args, params) -> None:
    for i in range(args.batch):
        engine.add_request(f"p{i}-{time.monotonic_ns()}", None, params,
                           prompt_token_ids=[(7 * i + j) % 31000 + 100
                                             for j in range(args.prompt_len)])
    while engine.scheduler.waiting:
        engine.step()  # the prompts


def gpu_time(fn, device: str, repeats: int = 50) -> float:
    """Seconds per call of ``fn``, the median of ``repeats`` back-to-back calls (CUDA events on
    a GPU: the kernels' time, not the launches')."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def projection_timing(model, batch: int, device: str) -> None:
    """LLaMA's q/k/v and gate/up projections as one matmul each (models/parallel_layers
    .FusedColumns) against the matmuls one by one, on layer 0's weights, ``batch`` tokens."""
    layer = model.layers[0]
    dtype = layer.self_attn.q_proj.weight.dtype
    x = torch.randn(batch, model.config.hidden_size, device=device, dtype=dtype)
    rows = []
    for name, fused in (("q/k/v", layer.self_attn.qkv), ("gate/up", layer.mlp.gate_up)):
        together = gpu_time(lambda: fused(x), device)
        apart = gpu_time(lambda: [l(x) for l in fused.linears], device)
        rows.append((name, together, apart))
    saved = sum(apart - together for _, together, apart in rows) * len(model.layers)
    what = "the kernels' time" if device == "cuda" else "wall time"
    print(f"projections, one matmul vs one by one (us per layer, {what}): "
          + "; ".join(f"{name} {1e6 * t:.1f} vs {1e6 * a:.1f}" for name, t, a in rows)
          + f"; over {len(model.layers)} layers the fused ones save {1e3 * saved:.2f} ms a step",
          flush=True)


def timed_steps(engine, device: str, num_steps: int) -> list[float]:
    times = []
    for _ in range(num_steps):
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def multi_step_decode(config, args, step: float, weight_floor: float) -> bool:
    """The decode step with ``num_scheduler_steps = --multi-steps``: ms per decode step, next to
    the single step's ``step`` seconds. False if a timed call did not run k steps."""
    k, device = args.multi_steps, args.device
    llm = build(config, args, eager=device != "cuda", num_scheduler_steps=k)
    try:
        engine = llm.llm_engine
        counters = engine.multi_step
        # (greedy, so the batch can go k steps at a time; no request stops before the last call)
        fill(engine, args, SamplingParams(temperature=0.0, ignore_eos=True,
                                          max_tokens=engine.max_model_len))
        timed_steps(engine, device, 1)  # warm-up: k decode steps
        runs, per_step, decodes = counters.num_runs, [], 0
        for _ in range(multi_step_calls(args)):
            later = counters.num_later_steps
            (seconds,) = timed_steps(engine, device, 1)  # one step(): up to k decode steps
            ran = 1 + counters.num_later_steps - later
            per_step.append(seconds / ran)
            decodes += ran
        calls = len(per_step)
        context = args.prompt_len + 1 + k + decodes // 2  # the timed decode steps' median
        ms = statistics.median(per_step)
        print(f"multi-step decode (num_scheduler_steps={k}): {1e3 * ms:.2f} ms per decode step "
              f"vs {1e3 * step:.2f} ms single-step ({ms / weight_floor:.2f}x the weight floor, "
              f"single-step {step / weight_floor:.2f}x); {decodes} decode steps in {calls} "
              f"step() calls at ~{context} tokens, median of the calls' ms per decode step "
              f"{1e3 * min(per_step):.2f} to {1e3 * max(per_step):.2f}; "
              f"{1e3 * (step - ms):.2f} ms a step saved ({100 * (1 - ms / step):.0f} %)",
              flush=True)
        engaged = counters.num_runs - runs == calls and decodes == k * calls
        if not engaged:
            print(f"multi-step decode did not engage as planned: {counters.num_runs - runs} "
                  f"multi-step runs in {calls} calls, {decodes} decode steps (want {k * calls})",
                  flush=True)
        return engaged
    finally:
        llm.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32, help="LLaMA-7B has 32")
    ap.add_argument("--hidden", type=int, default=4096, help="LLaMA-7B's; heads of 128")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed")
    ap.add_argument("--multi-steps", type=int, default=8,
                    help="num_scheduler_steps of the multi-step decode measured (1: skip it)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--no-profile", action="store_true", help="skip the eager profile")
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
    # A copy's bytes read + written per second: how fast the memory moves bytes either way,
    # and the rate benchmarks/kernel.py compares attention's reads with.
    read_bw = copy_bandwidth(device, (1 << 30) if device == "cuda" else (1 << 26))
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    params = SamplingParams(temperature=0.0, max_tokens=10 * args.steps + 16, ignore_eos=True)

    # 1-2. CUDA graphs (eager on the CPU): the step as the engine serves it
    llm = build(config, args, eager=device != "cuda")
    engine = llm.llm_engine
    fill(engine, args, params)
    timed_steps(engine, device, 2)  # warm-up (and graph capture)
    steps = timed_steps(engine, device, args.steps)
    step = statistics.median(steps)
    weights = engine.worker.memory_per_rank()[0]["weights"]
    shape = ModelShape.from_hf(config)
    context = args.prompt_len + 3 + args.steps // 2  # the timed steps' median context
    kv = args.batch * context * kv_bytes_per_token(
        shape.num_layers, shape.num_kv_heads, shape.head_size, 2 if device == "cuda" else 4)
    weight_floor, floor = weights / read_bw, (weights + kv) / read_bw
    graphs = getattr(engine.worker.model_runner, "graph_runner", None) is not None
    print(f"{name}: memory bandwidth {read_bw / 1e9:.0f} GB/s (a copy's read + write); "
          f"decode step of {args.batch} sequences at ~{context} tokens "
          f"({'CUDA graphs' if graphs and device == 'cuda' else 'eager'}): {1e3 * step:.2f} ms "
          f"(median of {len(steps)}, {1e3 * min(steps):.2f} to {1e3 * max(steps):.2f}); "
          f"reading the {weights / 1e9:.2f} GB of weights once takes {1e3 * weight_floor:.2f} ms: "
          f"{step / weight_floor:.2f}x the weight floor; with the {kv / 1e9:.2f} GB of K/V, "
          f"{1e3 * floor:.2f} ms: {step / floor:.2f}x the floor", flush=True)

    # 3. the same steps by section (on fresh requests)
    for request_id in [g.request_id for g in engine.scheduler.running]:
        engine.abort_request(request_id)
    b = decode_step_breakdown(llm, [[(5 * i + j) % 31000 + 100 for j in range(args.prompt_len)]
                                    for i in range(args.batch)], num_steps=args.steps)
    print("by section (ms per step, each closed by a synchronisation): "
          + ", ".join(f"{k} {1e3 * b[k]:.2f}" for k in
                      ("step", "schedule", "prepare", "model", "sample", "update", "python")
                      if b.get(k) is not None), flush=True)
    host = b["step"] - b["model"]
    print(f"the model: {1e3 * b['model']:.2f} ms = {b['model'] / weight_floor:.2f}x the weight "
          f"floor; everything else (host work, the sampler): {1e3 * host:.2f} ms", flush=True)
    projection_timing(engine.worker.model, args.batch, device)
    llm.shutdown()
    del llm, engine

    # 4. multi-step decode: the same model and prompts, k decode steps per schedule
    ok = True
    if args.multi_steps > 1:
        try:
            ok = multi_step_decode(config, args, step, weight_floor)
        except Exception:  # (report it and go on: the profile below is still worth having)
            traceback.print_exc()
            print("multi-step decode: failed (traceback above)", flush=True)
            ok = False
    if args.no_profile:
        return 0 if ok else 1

    # 5. eager, under the profiler
    llm = build(config, args, eager=True)
    engine = llm.llm_engine
    fill(engine, args, params)
    timed_steps(engine, device, 2)
    eager = statistics.median(timed_steps(engine, device, 3))
    print(f"eager decode step: {1e3 * eager:.2f} ms", flush=True)
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
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
