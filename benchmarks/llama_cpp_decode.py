"""llama.cpp's side of benchmarks/gguf_decode.py, run by another environment's python.

    /path/to/env/bin/python benchmarks/llama_cpp_decode.py FILE.gguf --prompt-ids 1,2,3 \
        --tokens 128 --repeats 3 --threads 2

It imports only ``llama_cpp`` (llama-cpp-python) and the standard library: it runs in an
environment of its own, never minipaged's (llama-cpp-python is not a dependency of minipaged).
Greedy decode of ``--tokens`` tokens after the prompt, timed as gguf_decode.py times the others:
``(tokens - 1) / (time of the whole request - time of a request of one token)``. Prints one JSON
line: the version, the tokens/s of each round, the tokens of the last round.
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--prompt-ids", required=True, help="token ids, comma-separated")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import llama_cpp

    prompt = [int(t) for t in args.prompt_ids.split(",")]
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=1024, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)

    def run(n: int) -> list[int]:
        tokens = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            tokens.append(int(token))
            if len(tokens) == n:
                break
        return tokens

    run(2)  # (a first run: the model's pages read, the threads started)
    rates, tokens = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run(1)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        tokens = run(args.tokens)
        whole = time.perf_counter() - t0
        rates.append((args.tokens - 1) / (whole - first) if whole > first else float("nan"))
    print(json.dumps({"version": llama_cpp.__version__, "tokens_per_s": rates,
                      "tokens": tokens}))


if __name__ == "__main__":
    main()
