"""Build every compiled back-end this machine can build and check that bad input raises.

    python scripts/check_compiled_ops.py                 # every back-end present here
    python scripts/check_compiled_ops.py --backends cuda # one of cpu_op, cuda_on_cpu, cuda

For each back-end: the build (its folder and time), the library check of
``minipaged/kernels/library_check.py`` (no private libstdc++ stream code; an error path that
formats a number raises), and the table of malformed inputs of ``minipaged/kernels/malformed.py``,
each case run in a child process so that a crash fails its case instead of the script.

The real CUDA kernels need a CUDA build of torch and nvcc, not a GPU: without one, the extension
is built for ``--arch`` (default 90, Hopper) and every error path reachable without a GPU is
called (``make cuda-ext-check`` does this on a CPU machine, in a separate environment). On a GPU
machine (``make gpu-check``, first stage) the malformed-input table runs on the GPU as well.

Exit status 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Error paths of the CUDA extension that need no GPU: (call with the module as m, expected message)
NO_GPU_CALLS = [
    ("paged_attention on host tensors",
     "m.paged_attention(torch.zeros(1, 4, 64), torch.zeros(1, 4, 64), torch.zeros(2, 4, 16, 16, 4),"
     " torch.zeros(2, 4, 64, 16), torch.zeros(1, 1, dtype=torch.int32),"
     " torch.ones(1, dtype=torch.int32), 0.125, 1, 0)", r"query must be a CUDA tensor, got cpu"),
    ("reshape_and_cache on host tensors",
     "m.reshape_and_cache(torch.zeros(1, 4, 64), torch.zeros(1, 4, 64), "
     "torch.zeros(2, 4, 16, 16, 4), torch.zeros(2, 4, 64, 16), torch.zeros(1, dtype=torch.long))",
     r"key must be a CUDA tensor, got cpu"),
    ("copy_blocks, a block past the pool",
     "m.copy_blocks([torch.zeros(6, 1, 1, 16, 4)], [torch.zeros(6, 1, 4, 16)], "
     "torch.tensor([[0, 9]]))", r"block numbers must be in \[0, 6\)"),
    ("copy_blocks, no layers", "m.copy_blocks([], [], torch.zeros(0, 2, dtype=torch.long))",
     r"one key cache and one value cache per layer"),
    ("swap_blocks, host to host",
     "m.swap_blocks(torch.zeros(4, 8), torch.zeros(4, 8), torch.tensor([[0, 7]]))",
     r"src or dst must be a CUDA tensor"),
    ("gguf_linear, a block format it does not read",
     "m.gguf_linear(torch.zeros(1, 32), torch.zeros(1, 34, dtype=torch.uint8), 7)",
     r"GGUF block format 7 is not supported: the kernel reads Q8_0 \(8\)"),
    ("gguf_linear on host tensors",
     "m.gguf_linear(torch.zeros(1, 32), torch.zeros(1, 34, dtype=torch.uint8), 8)",
     r"gguf_linear: x must be a CUDA tensor, got cpu"),
]


def check_cuda_without_gpu(arch: str) -> bool:
    """Build the CUDA extension for ``arch`` and call its error paths that need no GPU."""
    import torch

    from minipaged.kernels import build
    from minipaged.kernels.library_check import call_error_path, own_stream_symbols

    print(f"## cuda (no GPU here: built for sm_{arch}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda})")
    job = build.JitBuild("the CUDA kernels", "~2 min", lambda job: None)
    start = time.perf_counter()
    try:
        module = build.compile_cuda_extension(job, arch)
    except build.LibraryRefused as refused:
        print(f"REFUSED: {refused}")
        return False
    library = Path(module.__file__)
    symbols = own_stream_symbols(library)
    print(f"built or loaded in {time.perf_counter() - start:.0f} s: {library}")
    print(f"libstdc++ stream symbols the library defines itself: "
          f"{'nm not found' if symbols is None else len(symbols)}")
    ok = not symbols
    print("| error path | result | message |\n|---|---|---|")
    for name, call, expect in NO_GPU_CALLS:
        problem, message = call_error_path(library, module.__name__, call, expect)
        ok &= problem is None
        print(f"| {name} | {'ok, raised' if problem is None else 'FAIL: ' + problem} | "
              f"{message[:120]} |")
    return ok


def check_backend(backend: str) -> bool | None:
    """Load (building if needed) and run the malformed-input table; None if not available."""
    from minipaged.kernels import malformed

    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            kernels, _ = malformed.load_backend(backend)
        except Exception as error:  # noqa: BLE001 - a strict build's failure is reported
            print(f"## {backend}\nthe build failed: {type(error).__name__}: {error}")
            return False
    if kernels is None:
        if caught:  # built and refused, or failed to build: the torch reference would run
            print(f"## {backend}\nnot usable: {caught[0].message}")
            return False
        return None
    print(f"## {backend}\nloaded in {time.perf_counter() - start:.0f} s: "
          f"{kernels.module.__file__} (library check passed)")
    rows = malformed.run_table(backend)
    print(malformed.format_table(backend, rows))
    return all(row["ok"] for row in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="cpu_op,cuda_on_cpu,cuda",
                        help="comma-separated: cpu_op, cuda_on_cpu, cuda")
    parser.add_argument("--arch", default="90", help="GPU architecture when there is no GPU")
    args = parser.parse_args(argv)
    import torch

    results = {}
    for backend in args.backends.split(","):
        if backend == "cuda" and not torch.cuda.is_available():
            if torch.version.cuda is None:
                print("## cuda\nskipped: this torch is a CPU build (make cuda-ext-check builds the"
                      " CUDA extension against a CUDA build of torch)")
                continue
            os.environ.setdefault("MINIPAGED_CUDA_OP", "1")
            results[backend] = check_cuda_without_gpu(args.arch)
            continue
        result = check_backend(backend)
        if result is None:
            print(f"## {backend}\nskipped: not available here")
        else:
            results[backend] = result
    print("\nsummary: " + ", ".join(f"{b} {'ok' if r else 'FAILED'}" for b, r in results.items()))
    return 0 if results and all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
