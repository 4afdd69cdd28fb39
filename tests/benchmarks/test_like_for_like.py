"""The like-for-like benchmark (benchmarks/like_for_like.py): the small engines' trace drawn
exactly, its memory floor, and a run end to end on a tiny dummy model."""
import os
import subprocess
import sys

import pytest

from repo_paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import like_for_like  # noqa: E402


def test_the_trace_is_the_published_one():
    prompts, outputs = like_for_like.make_trace()
    assert len(prompts) == len(outputs) == 256
    assert sum(map(len, prompts)) == 142_827 and sum(outputs) == 133_966
    assert all(100 <= len(p) <= 1024 and all(0 <= t <= 10_000 for t in p) for p in prompts)
    assert all(100 <= o <= 1024 for o in outputs)
    again = like_for_like.make_trace()
    assert again == (prompts, outputs)  # seeded: the same every time


def test_the_floor_counts_weights_per_step_and_each_context_once_per_token():
    prompts, outputs = [[1] * 3, [1] * 5], [2, 4]
    # 4 decode steps read the weights (10 bytes); the contexts read: 3 + 4, then 5 + 6 + 7 + 8
    assert like_for_like.floor_bytes(prompts, outputs, 10, 2) == 4 * 10 + (7 + 26) * 2


def test_the_floor_on_an_h200_is_about_three_seconds():
    prompts, outputs = like_for_like.make_trace()
    shape = like_for_like.SHAPES["qwen3-0.6b"]
    hidden, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], \
        shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * 128, shape["num_key_value_heads"] * 128
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    weights = 2 * (layers * per_layer + shape["vocab_size"] * hidden + hidden)  # bf16, tied
    kv_per_token = 2 * layers * 2 * kv  # K and V, bf16
    seconds = like_for_like.floor_bytes(prompts, outputs, weights, kv_per_token) / 4.8e12
    assert 2.7 < seconds < 3.3  # the estimate: about 3.1 s at 4.8 TB/s


@pytest.mark.slow
def test_it_runs_on_a_tiny_dummy_model_on_the_cpu():
    proc = subprocess.run(
        [sys.executable, "benchmarks/like_for_like.py", "--dummy", "tiny-llama", "--num-seqs",
         "6", "--max-input-len", "120", "--max-output-len", "110", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = next(line for line in proc.stdout.splitlines()
               if line.startswith("| dummy tiny-llama"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "6" and float(cells[5].replace(",", "")) > 0
    assert cells[8].endswith("%")
    assert "of K/V per token" in proc.stdout


def test_lengths_under_the_benchmarks_bound_are_refused():
    with pytest.raises(SystemExit):
        like_for_like.main(["--max-input-len", "50"])
