"""Single-stream greedy decode on a GGUF file: its blocks as stored against float32 (issue 58).

    python benchmarks/gguf_decode.py                 # the embedded SmolLM2, 128 tokens
    python benchmarks/gguf_decode.py --small         # a tiny random LLaMA GGUF: seconds (tests)
    python benchmarks/gguf_decode.py --llama-cpp /path/to/env/bin/python   # and llama.cpp
    python benchmarks/gguf_decode.py --record        # and append the table to RESULTS.md

One prompt, greedy, ``--tokens`` new tokens, in one process and in turn (``--repeats`` rounds,
the median kept), each system on the same GGUF file:

- minipaged, ``quantization="gguf"``: the file's blocks, dequantized inside each matmul;
- minipaged, float32: the file converted through transformers (the default path);
- transformers: the file read by its GGUF loader (float32), ``generate``;
- llama.cpp (``llama-cpp-python``), in its own process with the python of another environment
  (``--llama-cpp PYTHON`` or ``$MINIPAGED_LLAMA_CPP_PYTHON``: ``benchmarks/llama_cpp_decode.py``),
  its rounds after ours; never a dependency of minipaged. Without one its row says "not
  measured" and a note says why.

Decode tokens/s counts the tokens after the first: ``(tokens - 1) / (time of the whole request -
time of a request of one token)``, so the prompt's prefill is not in it. The table also gives
the model's tensors (``gguf_loader.tensor_bytes``: parameters, buffers and blocks, shared storage
once) and whether the greedy tokens equal minipaged float32's.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.worker import checkpoint  # noqa: E402
from minipaged.worker.gguf_loader import tensor_bytes  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from machine import append_results, cpu_features, machine_description  # noqa: E402

PROMPT = "The block manager of a paged KV cache"


def timed(run, tokens: int) -> tuple[float, float, list[int]]:
    """(seconds for ``tokens`` tokens, seconds for one, the tokens) of ``run(n) -> tokens``."""
    t0 = time.perf_counter()
    run(1)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = run(tokens)
    return time.perf_counter() - t0, first, out


def minipaged_runner(model, prompt_ids, **settings):
    llm = LLM(model, dtype="float32", max_model_len=1024, **settings)

    def run(n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        out = llm.generate(prompt_token_ids=[prompt_ids], sampling_params=params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    return run, tensor_bytes(llm.llm_engine.worker.model)


def transformers_runner(gguf_path, prompt_ids):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    ids = torch.tensor([prompt_ids])

    @torch.no_grad()
    def run(n):
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    size = sum(t.untyped_storage().nbytes() for t in
               {t.untyped_storage().data_ptr(): t for t in model.state_dict().values()}.values())
    return run, size


LLAMA_CPP_ENV = "MINIPAGED_LLAMA_CPP_PYTHON"  # llama-cpp-python's environment's python


def llama_cpp_rounds(python: str | None, gguf_path: str, prompt_ids: list[int], tokens: int,
                     repeats: int, threads: int) -> tuple[list[float], list[int], str]:
    """llama.cpp on the same file, in its own process with ``python`` (an environment that has
    llama-cpp-python): (tokens/s of each round, the tokens, its version), or a ValueError
    saying why it was not measured."""
    if not python:
        raise ValueError(f"not measured: no llama-cpp-python environment given (--llama-cpp "
                         f"PYTHON or {LLAMA_CPP_ENV}; never a dependency of minipaged)")
    if not os.path.isfile(python):
        raise ValueError(f"not measured: {python} is not a file")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llama_cpp_decode.py")
    command = [python, script, gguf_path, "--prompt-ids", ",".join(map(str, prompt_ids)),
               "--tokens", str(tokens), "--repeats", str(repeats), "--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ValueError(f"not measured: {python} failed: {tail[0]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["tokens_per_s"], result["tokens"], f"llama-cpp-python {result['version']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None,
                        help="a .gguf file (default: the embedded SmolLM2)")
    parser.add_argument("--small", action="store_true",
                        help="a tiny random LLaMA written as GGUF, 8 tokens: a smoke run")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens (default 128)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["gguf", "float32", "transformers", "llama.cpp"])
    parser.add_argument("--llama-cpp", metavar="PYTHON", default=os.environ.get(LLAMA_CPP_ENV),
                        help="the python of an environment with llama-cpp-python: llama.cpp "
                             f"runs there on the same file (default: ${LLAMA_CPP_ENV})")
    parser.add_argument("--threads", type=int, default=2, help="threads of every system")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    tmp = None
    if args.small:
        from minipaged.lab.tiny_gguf import save_tiny_gguf

        tmp = tempfile.TemporaryDirectory()
        gguf_path, _ = save_tiny_gguf(tmp.name)
        # its conversions in the temporary folder too, not in the user's cache (whose root
        # also holds the compiled op: MINIPAGED_CACHE would compile it again)
        checkpoint.cache_root = lambda: tmp.name
        model, prompt_ids, tokens = gguf_path, list(range(2, 14)), args.tokens or 8
    else:
        model = args.model
        gguf_path = checkpoint.gguf_file(model)
        source, _ = checkpoint.resolve_quantized(model)
        prompt_ids = checkpoint.load_tokenizer(source).encode(PROMPT)
        tokens = args.tokens or 128

    systems = {"minipaged gguf": lambda: minipaged_runner(model, prompt_ids,
                                                          quantization="gguf"),
               "minipaged float32": lambda: minipaged_runner(model, prompt_ids,
                                                             quantization="none"),
               "transformers": lambda: transformers_runner(gguf_path, prompt_ids)}
    skip = {"gguf": "minipaged gguf", "float32": "minipaged float32"}
    skipped = {skip.get(s, s) for s in args.skip}
    runners, notes = {}, []
    for name, make in systems.items():
        if name in skipped:
            continue
        try:
            runners[name] = make()
        except ValueError as e:
            notes.append(f"{name}: not run ({e})")
    times = {name: [] for name in runners}
    outputs = {}
    for _ in range(args.repeats):
        for name, (run, _) in runners.items():  # in turn: a load that drifts falls on all
            whole, first, outputs[name] = timed(run, tokens)
            times[name].append((tokens - 1) / (whole - first) if whole > first else
                               float("nan"))  # (a tiny model: the difference is noise)
            print(f"  {name}: {times[name][-1]:.1f} tokens/s", flush=True)
    sizes = {name: size for name, (_, size) in runners.items()}
    llama_cpp = "not measured"
    if "llama.cpp" not in skipped:
        try:  # (its own process: its rounds run after ours, not in turn with them)
            times["llama.cpp"], outputs["llama.cpp"], llama_cpp = llama_cpp_rounds(
                args.llama_cpp, gguf_path, prompt_ids, tokens, args.repeats, args.threads)
            sizes["llama.cpp"] = os.path.getsize(gguf_path)
            print(f"  llama.cpp: {statistics.median(times['llama.cpp']):.1f} tokens/s",
                  flush=True)
        except ValueError as e:
            notes.append(f"llama.cpp: {e}")
    baseline = outputs.get("minipaged float32")
    rows = ["| system | decode tokens/s (median) | llama.cpp's / this | model's tensors (MB) | "
            "tokens = float32's |", "|---|---|---|---|---|"]
    reference = statistics.median(times["llama.cpp"]) if "llama.cpp" in times else None
    for name in ("llama.cpp", "minipaged gguf", "minipaged float32", "transformers"):
        if name not in times:
            if name not in skipped:
                rows.append(f"| {name} | not measured | - | - | - |")
            continue
        rate = statistics.median(times[name])
        same = "-" if baseline is None else ("yes" if outputs[name] == baseline else "no")
        ratio = f"{reference / rate:.2f}" if reference and rate == rate else "-"
        rows.append(f"| {name} | {rate:.1f} | {ratio} | {sizes[name] / 1e6:.1f} | {same} |")
    features = ", ".join(cpu_features()) or "none reported"
    facts = [f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             machine_description(), f"vector instructions (from the CPU's flags): {features}",
             f"{args.threads} threads each; llama.cpp: {llama_cpp}",
             f"model: {gguf_path if not args.small else 'tiny random'}",
             f"{tokens} new tokens, greedy, one prompt of {len(prompt_ids)} tokens, median of "
             f"{args.repeats} rounds"]
    body = "\n".join(rows + [""] + notes)
    print("\n".join(f"- {f}" for f in facts))
    print(body)
    if args.record:
        print("recorded in", append_results("GGUF decode, blocks as stored vs float32", facts,
                                            "", body))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
