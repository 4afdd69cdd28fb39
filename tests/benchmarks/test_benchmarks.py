"""The benchmark scripts run end to end (on a tiny dummy model, so CI stays fast).

Slow: ~160 s on the 2-core machine (measured at load ~12): every script is a subprocess that loads
torch and a model.
"""
import os
import subprocess
import sys

import pytest

from repo_paths import ROOT

pytestmark = pytest.mark.slow


def test_throughput_benchmark_runs_on_dummy_weights():
    proc = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--dummy", "tiny-llama", "--num-requests",
         "10", "--prompt-len", "4", "40", "--output-len", "4", "20", "--trace", "sharegpt",
         "--max-total", "60", "--static-batch", "4", "--num-scheduler-steps", "1", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "| minipaged |" in out and "transformers static batches of 4" in out
    assert "| minipaged, num_scheduler_steps=4 |" in out  # multi-step, the same trace
    assert "10 requests, minipaged, num_scheduler_steps=4: minipaged step-time" in out
    assert "transformers continuous batching" in out  # ran, or said why it did not
    assert "step-time breakdown" in out


def test_throughput_alternates_pairs_while_a_core_is_kept_busy():
    proc = subprocess.run(
        [sys.executable, "benchmarks/throughput.py", "--dummy", "tiny-llama", "--num-requests",
         "6", "--prompt-len", "4", "20", "--output-len", "4", "12", "--static-batch", "3",
         "--skip", "continuous", "--pairs", "2", "--busy", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "pair 1 (hf first)" in out and "pair 2 (minipaged first)" in out
    assert "alternating pairs on 6 requests, minipaged's speed-up vs transformers static: " \
           "median " in out
    assert "1 other process(es) each keeping a core busy" in out
    assert "minipaged chooses per step" in out


def test_live_page_benchmark_runs_in_its_small_mode():
    """(the event stream only: the browser's mode is the full run's, on a quiet machine)"""
    proc = subprocess.run(
        [sys.executable, "benchmarks/live_page.py", "--small", "--rounds", "2", "--max-tokens",
         "8", "--num-requests", "4", "--page", "stream"], cwd=ROOT, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    rounds = [line for line in lines if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rounds) == 2  # A, B, A, B: two rounds of (without, with)
    for row in rounds:
        cells = [c.strip() for c in row.strip("|").split("|")]
        # (each stream had its first frame before the clock started; a run this short may see
        # no other: frames are spaced to cost the engine at most 5 % of its time)
        assert float(cells[1]) > 0 and float(cells[2]) > 0 and int(cells[3]) >= 0
    assert next(line for line in lines if line.startswith("| median |"))
    assert any(line.startswith("CPU: ") for line in lines)  # the CPU named
    assert any(line.startswith("date: 20") and line.endswith(" UTC") for line in lines)
    assert "with / without the page (medians): " in proc.stdout


def test_serving_benchmark_runs_on_a_tiny_model(tmp_path):
    from tiny_models import save_tiny_model

    save_tiny_model("llama", tmp_path, vocab_size=1000)
    proc = subprocess.run(
        [sys.executable, "benchmarks/serving.py", "--model", str(tmp_path), "--rates", "20",
         "--num-requests", "6", "--prompt-len", "4", "12", "--output-len", "5"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 20 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "6" and float(cells[4]) > 0  # all 6 answered, tokens/s measured


def test_chunked_prefill_benchmark_runs_on_a_tiny_model(tiny_llama, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import chunked_prefill

    assert chunked_prefill.main(["--model", tiny_llama[0], "--budget", "16", "--num-decoders",
                                 "2", "--decode-tokens", "12", "--num-long", "2", "--long-len",
                                 "60", "90", "--every", "3", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "| chunked, budget 16 |" in out and "p99 TPOT" in out


def test_speculative_benchmark_runs_on_a_tiny_model(tiny_llama, capsys):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import speculative

    assert speculative.main(["--model", tiny_llama[0], "--quick"]) == 0  # outputs identical
    out = capsys.readouterr().out
    assert "| copying | 1 |" in out and "| open-ended chat | 2 |" in out
    assert "greedy outputs identical with and without speculation" in out


def test_kernel_benchmark_rotates_past_twice_the_l2_and_warns_when_capped():
    """benchmarks/kernel.py needs a GPU to time anything; --help and the rotation rule do not."""
    import importlib.util

    proc = subprocess.run([sys.executable, "benchmarks/kernel.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--quick" in proc.stdout, proc.stderr[-2000:]
    spec = importlib.util.spec_from_file_location(
        "kernel_benchmark", os.path.join(ROOT, "benchmarks", "kernel.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    l2 = 50 * 2**20  # an H100
    for batch, context in [(1, 128), (8, 512), (64, 1024), (256, 16384)]:
        per_copy = bench.kv_bytes(batch, context)
        copies, warning = bench.rotation_copies(per_copy, l2)
        assert warning is None and copies * per_copy > 2 * l2
        assert copies == 1 or (copies - 1) * per_copy <= 2 * l2  # no more copies than needed
    assert bench.rotation_copies(bench.kv_bytes(1, 128), l2)[0] > 16  # the old cap was 16
    copies, warning = bench.rotation_copies(2**20, l2, max_bytes=8 * 2**20)
    assert copies == 8 and "warning" in warning and "L2" in warning


@pytest.mark.parametrize("k", [1, 4], ids=["single-step", "multi-step"])
def test_host_step_benchmark_prints_its_table(k):
    proc = subprocess.run(
        [sys.executable, "benchmarks/host_step.py", "--batches", "3", "--steps", "2", "--vocab",
         "500", "--prompt-len", "5", "--num-scheduler-steps", str(k)], cwd=ROOT,
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 3 |"))
    cells = [float(c) for c in row.strip("|").split("|")[1:]]
    assert len(cells) == 8 and all(c >= 0 for c in cells[:5])
    # per decode step: every timed step() ran k of them (else a line says how many)
    assert ("num_scheduler_steps=4" in proc.stdout) == (k == 4)
    assert "decode steps, not" not in proc.stdout


def test_hybrid_kv_benchmark_small():
    proc = subprocess.run([sys.executable, "benchmarks/hybrid_kv.py", "--small"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "| 4,096 | 72.00 MiB | 19.73 MiB | 3.65x |" in out  # Gemma 3 270M's numbers
    assert "| 32,768 | 576.00 MiB | 103.73 MiB | 5.55x |" in out
    assert "equal to every block's" in out and "DIFFER" not in out


def test_gguf_decode_benchmark_runs_on_a_tiny_gguf_file():
    proc = subprocess.run(
        [sys.executable, "benchmarks/gguf_decode.py", "--small", "--repeats", "1"], cwd=ROOT,
        capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "MINIPAGED_LLAMA_CPP_PYTHON"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    for system in ("minipaged gguf", "minipaged float32", "transformers"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {system} |"))
        assert row.rstrip().endswith("| yes |"), row  # the same greedy tokens
    assert "| llama.cpp | not measured |" in out  # (no environment given: said, not guessed)
    assert "llama.cpp: not measured: no llama-cpp-python environment given" in out
    assert "vector instructions (from the CPU's flags):" in out and "date: " in out


def test_gguf_throughput_benchmark_small():
    proc = subprocess.run([sys.executable, "benchmarks/gguf_throughput.py", "--small",
                           "--repeats", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "greedy tokens the same for every request: yes" in proc.stdout
    assert "| gguf |" in proc.stdout and "| float32 |" in proc.stdout
