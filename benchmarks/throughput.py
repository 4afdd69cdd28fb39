"""Throughput: minipaged against transformers on the same machine, model and trace.

    python benchmarks/throughput.py                       # CPU, embedded model, 64 requests
    python benchmarks/throughput.py --device cuda --dummy llama-7b --trace sharegpt \
        --num-requests 1000 --dtype float16               # the GPU benchmark (issue 6)

Three systems run the same seeded trace of requests (greedy, ``ignore_eos``, each request with its
own output length):
  * minipaged: continuous batching over paged KV blocks;
  * transformers ``generate`` in static padded batches: every batch runs until its longest
    request is done; only the tokens each request asked for are counted;
  * transformers' own continuous batching (``generate_batch`` machinery, paged attention), where
    it runs on this machine.
It prints a table per trace size (``--num-requests 16 64 256``: requests/s, output tokens/s,
ratios), the engine's step-time breakdown, one decode step of (up to) 64 sequences taken apart
(attention, linear layers, other model work, sampling, scheduling, Python; see
minipaged/lab/step_breakdown.py) with its achieved fraction of the matmul peak measured in the
same run, and, as its last line,

    speed-up vs transformers static: X.XXx, vs generate_batch: Y.YYx

for the last trace size. With ``--record`` it appends all of it to benchmarks/RESULTS.md with the
date, the machine and its CPU capability.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import math
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.lab.roofline import measure_matmul_peak  # noqa: E402
from minipaged.lab.step_breakdown import (cpu_capability_notes, decode_step_breakdown,  # noqa: E402
                                          format_decode_breakdown)

sys.path.insert(0, os.path.dirname(__file__))
from machine import machine_description  # noqa: E402

# Model shapes for dummy weights (no model hub needed).
DUMMY_SHAPES = {
    "llama-7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                     vocab_size=32000, max_position_embeddings=2048),
    "gpt2": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257,
                 n_positions=1024),
    "tiny-llama": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=256, max_position_embeddings=512),
}


# ----------------------------------------------------------------------------------------------
# The trace
# ----------------------------------------------------------------------------------------------
def make_trace(kind: str, num: int, prompt_range, output_range, max_total: int, vocab: int,
               seed: int) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)], seeded.

    ``uniform``: lengths uniform in the given ranges. ``sharegpt``: log-normal lengths shaped
    like the ShareGPT conversations vLLM benchmarks with (long-tailed, median prompt ~ 100 and
    output ~ 200 tokens), kept to vLLM's filter: prompt 4-1024, output 4-1024, sum <= 2048.
    """
    rng = random.Random(seed)
    trace = []
    while len(trace) < num:
        if kind == "uniform":
            p = rng.randint(*prompt_range)
            o = rng.randint(*output_range)
        elif kind == "sharegpt":
            p = int(rng.lognormvariate(math.log(100), 1.1))
            o = int(rng.lognormvariate(math.log(200), 0.9))
        else:
            raise ValueError(kind)
        if not (prompt_range[0] <= p <= prompt_range[1] and output_range[0] <= o <= output_range[1]
                and p + o <= max_total):
            continue
        low = min(100, vocab // 4)  # skip the special tokens at the start of most vocabularies
        trace.append(([rng.randrange(low, vocab) for _ in range(p)], o))
    return trace


# ----------------------------------------------------------------------------------------------
# The three systems
# ----------------------------------------------------------------------------------------------
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_minipaged(llm: LLM, trace) -> dict:
    engine = llm.llm_engine
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in trace]
    # NOTE: every run computes every prompt: neither an earlier run of the same trace (--pairs)
    # nor the warm-up leaves cached blocks for it to find
    assert llm.reset_prefix_cache(), "a request still holds blocks"
    llm.generate(prompt_token_ids=[trace[0][0]], sampling_params=params[:1], use_tqdm=False)
    llm.reset_prefix_cache()
    before = engine.stats.as_dict()
    sync(engine.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[p for p, _ in trace], sampling_params=params,
                        use_tqdm=False)
    sync(engine.device)
    elapsed = time.perf_counter() - t0
    after = engine.stats.as_dict()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == sum(o for _, o in trace), "minipaged generated a different number of tokens"
    stats = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
    stats["peak_gpu_blocks_used"] = after["peak_gpu_blocks_used"]
    return {"time": elapsed, "tokens": tokens, "stats": stats,
            "num_gpu_blocks": engine.block_manager.num_total_gpu_blocks}


@torch.inference_mode()
def run_hf_static(model, trace, batch_size: int, pad_id: int, device) -> dict:
    """Static batching: pad each batch to its longest prompt, run to its longest output.

    The padded prompt plus the longest output may pass the model's position limit (GPT-2: 1024)
    even when every request fits on its own: the batch then stops at the limit (on a GPU,
    running past it was a device-side assert in the position embedding, 2026-11-26), and only
    the tokens generated count."""
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    generated = 0

    def one_batch(batch):
        nonlocal generated
        width = max(len(p) for p, _ in batch)
        new_tokens = min(max(o for _, o in batch), limit - width)
        generated += sum(min(o, new_tokens) for _, o in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        model.generate(ids.to(device), attention_mask=mask.to(device),
                       max_new_tokens=new_tokens, min_new_tokens=None,
                       do_sample=False, eos_token_id=None, pad_token_id=pad_id)

    one_batch(trace[:2])  # warm-up
    sync(device)
    generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(trace), batch_size):
        one_batch(trace[i:i + batch_size])
    sync(device)
    return {"time": time.perf_counter() - t0, "tokens": generated}


def run_hf_continuous(model, trace, device) -> dict:
    """transformers' continuous batching (paged KV cache), one request per trace entry."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(o for _, o in trace), do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    with model.continuous_batching_context_manager(generation_config=config, block=True,
                                                   timeout=5) as manager:
        sync(device)
        t0 = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=o, eos_token_id=-1) for p, o in trace]
        done, tokens = set(), 0
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching stopped early")
                continue
            if result.is_finished() and result.request_id not in done:
                if result.error is not None:
                    raise RuntimeError(f"transformers' continuous batching: {result.error}")
                done.add(result.request_id)
                tokens += len(result.generated_tokens)
        sync(device)
        elapsed = time.perf_counter() - t0
    return {"time": elapsed, "tokens": tokens}


# ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dummy", choices=sorted(DUMMY_SHAPES), default=None,
                    help="random weights of this shape instead of a checkpoint")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--trace", choices=["uniform", "sharegpt"], default="uniform")
    ap.add_argument("--num-requests", type=int, nargs="+", default=[64],
                    help="one or more trace sizes, e.g. 16 64 256; the last line is for the last")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 128])
    ap.add_argument("--max-total", type=int, default=2048)
    ap.add_argument("--static-batch", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0, help="CPU KV budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1],
                    help="minipaged's num_scheduler_steps (multi-step decode); each value after "
                         "the first runs the traces again in an engine of that setting, with "
                         "the same weights")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="on CUDA: no CUDA graphs for decode steps (compare with and without)")
    ap.add_argument("--skip", default="", help="comma list of: static, continuous")
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    ap.add_argument("--note", default="", help="a remark recorded with the results")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: the engine chooses per step; transformers "
                         "runs with torch's default)")
    ap.add_argument("--pairs", type=int, default=0,
                    help="then time minipaged and transformers' static batches this many more "
                         "times on the last trace, alternating which goes first, and give the "
                         "median of the pairs' ratios (a load that comes and goes falls on both)")
    ap.add_argument("--busy", type=int, default=0,
                    help="start this many processes that keep a core busy each, for the whole "
                         "run (a machine where other programs run)")
    args = ap.parse_args(argv)
    busy = [multiprocessing.Process(target=_keep_a_core_busy, daemon=True)
            for _ in range(args.busy)]
    for process in busy:
        process.start()
    try:
        return _main(args)
    finally:
        for process in busy:
            process.terminate()
            process.join()


def _keep_a_core_busy() -> None:  # (--busy: another program's work, until terminated)
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2147483648


def _main(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoConfig, AutoModelForCausalLM

    if args.dummy:
        shape = dict(DUMMY_SHAPES[args.dummy])
        config = AutoConfig.for_model(shape.pop("model_type"), **shape)
        config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
        model_dir = tempfile.mkdtemp(prefix="minipaged-dummy-")
        atexit.register(shutil.rmtree, model_dir, True)  # (only a config.json in it)
        config.save_pretrained(model_dir)
        llm_kwargs = dict(load_format="dummy")
        model_name = f"dummy {args.dummy}"
    else:
        from minipaged.worker.checkpoint import EMBEDDED_MODEL, resolve

        model_dir = resolve(args.model)
        config = AutoConfig.from_pretrained(model_dir)
        llm_kwargs = {}
        model_name = args.model or EMBEDDED_MODEL

    def build(num_scheduler_steps: int) -> LLM:
        return LLM(model_dir, dtype=args.dtype, device=args.device, block_size=args.block_size,
                   max_num_seqs=args.max_num_seqs,
                   kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
                   enforce_eager=args.enforce_eager, num_scheduler_steps=num_scheduler_steps,
                   cpu_threads=args.threads, **llm_kwargs)

    first_k, *other_ks = args.num_scheduler_steps
    llm = build(first_k)
    engine = llm.llm_engine
    device, dtype = engine.device, engine.dtype
    machine = machine_description(device)
    if device.type == "cpu":
        machine += "; " + cpu_capability_notes(dtype)
        machine += (f"; torch threads: {args.threads} pinned" if args.threads else
                    "; torch threads: minipaged chooses per step, transformers runs with "
                    f"{torch.get_num_threads()}")
    if args.busy:
        machine += f"; {args.busy} other process(es) each keeping a core busy (--busy)"
    peak = measure_matmul_peak(n=2048, dtype=dtype, repeats=4, device=device)
    runner = getattr(engine.worker, "model_runner", None)  # none in a tensor-parallel driver
    graphs = getattr(runner, "graph_runner", None) is not None
    print(f"model {model_name} on {machine}, {dtype}; matmul peak {peak / 1e9:.1f} GFLOP/s; "
          f"CUDA graphs {'on' if graphs else 'off'}", flush=True)

    # Every trace size runs the three systems on the same weights, one after another.
    traces = {n: make_trace(args.trace, n, args.prompt_len, args.output_len, args.max_total,
                            config.vocab_size, args.seed) for n in args.num_requests}
    runs = {n: {} for n in traces}
    for n, trace in traces.items():
        runs[n]["minipaged"] = run_minipaged(llm, trace)
        print(f"  {n} requests: minipaged {runs[n]['minipaged']['time']:.1f} s", flush=True)
    largest = traces[max(traces)]
    prompts = [p for p, _ in largest][:min(64, len(largest))]
    threads = torch.get_num_threads()
    breakdown = decode_step_breakdown(llm, prompts)
    torch.set_num_threads(threads)  # (its steps choose threads; transformers keeps the caller's)
    print("  " + format_decode_breakdown(breakdown, peak), flush=True)
    # Our weights go to transformers: same weights, and the KV pool is freed first (with
    # --pairs it is kept for the pairs at the end: on a GPU the later engines then get less).
    state = {k: v for k, v in engine.worker.model.state_dict().items()}
    if not args.pairs:
        llm.shutdown()  # the KV pool, the CUDA graphs and torch's cached blocks go back
        del llm
    del engine
    for k in other_ks:  # multi-step decode: the same weights, k decode steps per schedule
        other = build(k)
        other.llm_engine.worker.model.load_state_dict(state)
        name = f"minipaged, num_scheduler_steps={k}"
        for n, trace in traces.items():
            runs[n][name] = run_minipaged(other, trace)
            print(f"  {n} requests: {name} {runs[n][name]['time']:.1f} s", flush=True)
        other.shutdown()
        del other

    skip = set(filter(None, args.skip.split(",")))
    hf = None
    if args.pairs or not ({"static", "continuous"} <= skip):
        if args.dummy:
            hf = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
            hf.load_state_dict(_hf_names(state, config), strict=False)
        else:
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        hf.eval()
    del state
    for n, trace in traces.items():
        if "static" not in skip:
            runs[n]["hf static"] = run_hf_static(hf, trace, args.static_batch, 0, device)
            print(f"  {n} requests: transformers static batches of {args.static_batch}: "
                  f"{runs[n]['hf static']['time']:.1f} s", flush=True)
        if "continuous" not in skip:
            try:
                runs[n]["hf continuous"] = run_hf_continuous(hf, trace, device)
                print(f"  {n} requests: transformers continuous batching: "
                      f"{runs[n]['hf continuous']['time']:.1f} s", flush=True)
            except Exception as e:  # report, don't hide: it may not support this device
                runs[n]["hf continuous"] = {"error": f"{type(e).__name__}: {e}"[:200]}
                print(f"  transformers continuous batching did not run: "
                      f"{runs[n]['hf continuous']['error']}", flush=True)

    pairs_line = ""
    if args.pairs:
        trace = traces[args.num_requests[-1]]
        ratios = []
        for i in range(args.pairs):
            order = ("hf", "minipaged") if i % 2 == 0 else ("minipaged", "hf")
            times = {}
            for system in order:
                times[system] = (run_hf_static(hf, trace, args.static_batch, 0, device)
                                 if system == "hf" else run_minipaged(llm, trace))["time"]
            ratios.append(times["hf"] / times["minipaged"])
            print(f"  pair {i + 1} ({order[0]} first): {ratios[-1]:.2f}x", flush=True)
        llm.shutdown()
        pairs_line = (f"alternating pairs on {len(trace)} requests, minipaged's speed-up vs "
                      f"transformers static: median {statistics.median(ratios):.2f}x "
                      f"({', '.join(f'{r:.2f}x' for r in ratios)})")
    tables = [f"{n} requests:\n\n" + format_table(runs[n], args.static_batch, n,
                                                    sum(o for _, o in traces[n]))
              for n in traces]
    engine_breakdowns = [f"{n} requests, {name}: " + format_breakdown(
                             r["stats"], r["num_gpu_blocks"], device.type == "cuda")
                         for n in traces for name, r in runs[n].items()
                         if name.startswith("minipaged")]
    decode = format_decode_breakdown(breakdown, peak)
    report = "\n\n".join(tables + engine_breakdowns + [decode] + ([pairs_line] if pairs_line
                                                                    else []))
    last = speedup_line(runs[args.num_requests[-1]])
    print("\n" + report + "\n\n" + last)
    if args.record:
        record(report + "\n\n" + last, args, model_name, machine, device, dtype, traces)
        print(last)  # the last line stays the speed-up line
    return 0


def speedup_line(results: dict) -> str:
    """The benchmark's last line: minipaged's speed-up over both transformers baselines."""
    def ratio(name):
        r = results.get(name)
        if r is None or "error" in r:
            return "n/a"
        return f"{r['time'] / results['minipaged']['time']:.2f}x"

    return (f"speed-up vs transformers static: {ratio('hf static')}, "
            f"vs generate_batch: {ratio('hf continuous')}")


def _hf_names(state: dict, config) -> dict:
    """Our parameter names -> transformers' (for handing dummy weights over)."""
    out = {}
    for k, v in state.items():
        if config.model_type == "llama":
            out["lm_head.weight" if k == "lm_head.weight" else f"model.{k}"] = v
        else:
            out[f"transformer.{k}"] = v
    if config.model_type == "gpt2" or getattr(config, "tie_word_embeddings", False):
        emb = "transformer.wte.weight" if config.model_type == "gpt2" else "model.embed_tokens.weight"
        out["lm_head.weight"] = out[emb]
    return out


def format_table(results: dict, static_batch: int, num_requests: int, num_out: int) -> str:
    base = results["minipaged"]
    lines = ["| system | time (s) | requests/s | output tokens/s | minipaged speed-up |",
             "|---|---:|---:|---:|---:|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | did not run: {r['error']} | | | |")
            continue
        label = f"transformers static batches of {static_batch}" if name == "hf static" \
            else ("transformers continuous batching (generate_batch)"
                  if name == "hf continuous" else name)
        speedup = f"{r['time'] / base['time']:.2f}x"
        if name == "minipaged":
            speedup = "1.00"
        elif name.startswith("minipaged"):  # another setting: its speed against the first's
            speedup = f"(this row: {base['time'] / r['time']:.2f}x the first row's speed)"
        lines.append(f"| {label} | {r['time']:.1f} | {num_requests / r['time']:.2f} | "
                     f"{r['tokens'] / r['time']:.1f} | {speedup} |")
    return "\n".join(lines)


def format_breakdown(stats: dict, num_gpu_blocks: int, on_cuda: bool = False) -> str:
    """The engine's own step timers over a whole run.

    NOTE: they read the clock without synchronising (the engine does not wait for the device
    between its phases). On CUDA the model's kernels finish while the sampler waits for the
    logits, so the two are shown as one section, "model + sample"; the decode breakdown
    (``decode_step_breakdown``) synchronises and separates them."""
    totals = {p: stats[f"time_{p}"] for p in ("schedule", "prepare", "model", "sample", "update")}
    if on_cuda:
        totals["model + sample"] = totals.pop("model") + totals.pop("sample")
    total = sum(totals.values()) or 1.0
    steps = max(stats["num_steps"], 1)
    cells = ", ".join(f"{p} {t:.2f} s ({100 * t / total:.0f} %)" for p, t in totals.items())
    return (f"minipaged step-time breakdown over {stats['num_steps']} steps "
            f"({1000 * total / steps:.1f} ms/step): {cells}. Peak KV blocks in use "
            f"{stats['peak_gpu_blocks_used']} of {num_gpu_blocks}; preemptions "
            f"{stats['num_preemptions_recompute']} recompute, {stats['num_preemptions_swap']} swap; "
            f"{stats['num_generation_tokens'] / steps:.1f} decode tokens per step on average.")


def record(report, args, model_name, machine, device, dtype, traces) -> None:
    import transformers

    path = os.path.join(os.path.dirname(__file__), "RESULTS.md")
    today = datetime.date.today().isoformat()
    sizes = ", ".join(str(n) for n in traces)
    header = (f"\n## Throughput: {model_name}, {device.type}, {dtype} ({today})\n\n"
              f"- machine: {machine}\n"
              f"- versions: torch {torch.__version__}, transformers {transformers.__version__}\n"
              f"- trace: {args.trace}, {sizes} requests, seed {args.seed}, prompt "
              f"{args.prompt_len[0]}-{args.prompt_len[1]}, output {args.output_len[0]}-"
              f"{args.output_len[1]} tokens, greedy, ignore_eos; dtype {dtype}; block size "
              f"{args.block_size}\n"
              f"- command: `python benchmarks/throughput.py {' '.join(sys.argv[1:])}`\n"
              + (f"- note: {args.note}\n" if args.note else "") + "\n")
    with open(path, "a") as f:
        f.write(header + report + "\n")
    print(f"recorded in {path}")


if __name__ == "__main__":
    raise SystemExit(main())
