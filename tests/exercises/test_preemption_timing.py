"""Lesson 04's measurement of one preemption (exercises/preemption_timing.py), on a tiny random
model: both costs measured, the GPU model's curves beside them, and the sentences about them."""
from __future__ import annotations

import pytest

from minipaged import LLM
from minipaged.exercises import lesson16, preemption_timing
from minipaged.lab import kv_memory


@pytest.fixture(scope="module")
def tiny_llm():
    settings = lesson16.tiny_settings(block_size=4, num_gpu_blocks=16, num_cpu_blocks=16)
    llm = LLM(settings.pop("model", None), **settings)
    yield llm
    llm.llm_engine.shutdown()


def test_both_costs_are_measured_at_every_length(tiny_llm):
    measured = preemption_timing.measure_lengths(tiny_llm, [4, 16], runs=2)
    assert sorted(measured) == [4, 16]
    assert all(recompute > 0 and swap > 0 for recompute, swap in measured.values())
    shape = kv_memory.MODEL_SHAPES["SmolLM2-135M"]
    curves = preemption_timing.curves(measured, 135_000_000, 4, shape)
    assert len(curves) == 4 and all([n for n, _ in c] == [4, 16] for c in curves.values())
    assert preemption_timing.growth_line(measured).startswith("4x the tokens took: recompute ")
    lines = preemption_timing.cheaper_lines(measured, 135_000_000, 4, shape)
    assert lines[0].startswith("measured here: ") and lines[1].startswith("GPU model, blocks of 4")


def test_the_sentences_follow_the_numbers():
    measured = {16: (0.010, 0.001), 128: (0.080, 0.001)}
    assert "recompute 8.0x (about in proportion), swap 1.0x (less than in proportion)" in \
        preemption_timing.growth_line(measured)
    shape = kv_memory.MODEL_SHAPES["SmolLM2-135M"]
    assert "swap is cheaper at every length: the measured curves do not cross" in \
        preemption_timing.cheaper_lines(measured, 135_000_000, 16, shape)[0]
    crossing = {16: (0.001, 0.002), 128: (0.080, 0.001)}
    assert "depending on the length: the measured curves cross" in \
        preemption_timing.cheaper_lines(crossing, 135_000_000, 16, shape)[0]


def test_a_length_that_is_not_a_positive_count_is_refused(tiny_llm):
    with pytest.raises(ValueError, match="positive number of tokens"):
        preemption_timing.measure(tiny_llm, 0)
