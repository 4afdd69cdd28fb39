"""Lesson 06: the kernels under ThreadSanitizer and AddressSanitizer, on the CPU.

csrc/cuda_on_cpu/sanitize_main.cpp runs small cases of every kernel (V1, V2 and its reduce kernel in all
three dtypes, an empty context between real ones, V2's and version 3's fused reduce with the blocks
shuffled, reshape_and_cache, copy_blocks, swap_blocks, and the cache launchers after a stale error
of an earlier launch, gguf_linear in every block format), built with the real .cu files and
one host thread per CUDA thread. No Python or torch runs in that process, so a report is about
our code:

- ThreadSanitizer: no data race. To show that a missing barrier *would* be caught, the same
  program is built with one ``__syncthreads()`` of paged_attention.cu compiled out (the one
  between writing the probabilities and reading them in phase 4): TSan must report a race there.
- AddressSanitizer: no read or write outside a cache, a block table, or shared memory (every
  buffer, dynamic shared memory included, is allocated at its exact size).

The first run compiles the programs (a minute or two each; cached under
~/.cache/minipaged/torch_ext/sanitize). ``make sanitize`` runs only these tests.

Slow: ~90 s on the 2-core machine (measured at load ~12): two sanitizer builds and their runs.
"""
import os
import re
import shutil
import subprocess

import pytest

from minipaged.kernels import cuda_on_cpu

pytestmark = [pytest.mark.lesson05, pytest.mark.slow,
              pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")]

DROPPED = "every probability is written before any warp reads them"  # the barrier's comment
TIMEOUT = 600


def run(program, *args, **env):
    return subprocess.run([str(program), *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, **env})


def test_thread_sanitizer_finds_no_data_race():
    result = run(cuda_on_cpu.build_sanitizer_program("thread"),
                 TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "all cases passed" in result.stdout


def test_thread_sanitizer_catches_a_removed_syncthreads():
    program = cuda_on_cpu.build_sanitizer_program("thread", drop_barrier=DROPPED)
    result = run(program, "V1 float32", TSAN_OPTIONS="halt_on_error=1 exitcode=66")
    print(result.stderr[:3000])
    assert result.returncode == 66, "TSan did not stop the program"
    assert "WARNING: ThreadSanitizer: data race" in result.stderr
    # both sides of the race are in the attention kernel: the normalising write of a
    # probability and its read in phase 4
    frames = re.findall(r"paged_attention\.cu:(\d+)", result.stderr)
    assert len(frames) >= 2, result.stderr[:3000]


def test_address_sanitizer_finds_no_bad_access():
    result = run(cuda_on_cpu.build_sanitizer_program("address"),
                 ASAN_OPTIONS="halt_on_error=1 detect_leaks=0")
    assert "AddressSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    assert "all cases passed" in result.stdout


def test_dropping_a_barrier_needs_a_barrier_to_drop():
    with pytest.raises(ValueError, match="no line"):
        cuda_on_cpu.rewrite_cuda_source("__global__ void k() {}", "k.cu", drop_barrier="nothing")
