"""The cost model of lesson 15 (minipaged/lab/roofline.py) counts what the engine really does."""
import math

import pytest
import torch

from minipaged.lab import roofline as rl
from minipaged.lab.kv_memory import MODEL_SHAPES
from minipaged.lab.step_breakdown import decode_step_breakdown
from minipaged.model_shape import ModelShape

pytestmark = pytest.mark.lesson15

SMOL = MODEL_SHAPES["SmolLM2-135M"]


def test_weight_count_of_smollm2_is_its_parameter_count_less_norms():
    # 134,515,008 parameters in all; less 61 RMSNorm vectors of 576 = 134,479,872 (the
    # embedding is tied to the LM head, which is counted once as a matrix a step reads)
    assert SMOL.weight_params == 134_515_008 - 61 * 576
    assert SMOL.kv_bytes_per_token(2) == 2 * 30 * 3 * 64 * 2


def test_decode_intensity_grows_with_the_batch_and_tends_to_half_a_flop_per_byte_at_one():
    one = rl.decode_step(SMOL, 1, 1, 4)
    assert one.intensity == pytest.approx(0.5, rel=1e-3)  # 2 FLOPs per 4-byte weight
    ratios = [rl.decode_step(SMOL, b, 64, 2).intensity for b in (1, 2, 4, 8, 16)]
    assert all(b > a for a, b in zip(ratios, ratios[1:]))
    # the KV read grows with B too, so intensity stays below 2 FLOPs per (2-byte) weight x B
    assert ratios[-1] < 16


def test_prefill_is_far_more_intense_than_decode():
    decode = rl.decode_step(SMOL, 1, 512, 2)
    assert rl.prefill_step(SMOL, [512], 2).intensity > 100 * decode.intensity


def test_roofline_and_step_time():
    m = rl.Machine("m", peak_flops=100.0, bandwidth=10.0)
    assert m.ridge == 10.0
    assert m.attainable(1.0) == 10.0 and m.attainable(1000.0) == 100.0
    assert m.step_seconds(rl.StepCost(flops=100.0, bytes=50.0)) == 5.0  # memory-bound
    assert rl.H100_SXM.ridge == pytest.approx(295, rel=0.01)
    # LLaMA-7B: 6.5 G weights read per step (its 6.7 G parameters less the embedding table)
    assert MODEL_SHAPES["LLaMA-7B"].weight_params == pytest.approx(6.61e9, rel=0.01)


def test_max_batch_size_counts_whole_blocks():
    assert rl.max_batch_size(16 * 10 * 3, 10, 16, 17) == 1  # 3 blocks; 2 per sequence
    assert rl.max_batch_size(16 * 10 * 4, 10, 16, 32) == 2
    assert rl.max_batch_size(16 * 10 * 4 - 1, 10, 16, 32) == 1
    assert rl.max_batch_size(0, 10, 16, 32) == 0
    with pytest.raises(ValueError, match="seq_len"):
        rl.max_batch_size(100, 10, 16, 0)
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        rl.max_batch_size(-1, 10, 16, 4)
    with pytest.raises(ValueError, match="batch_size"):
        rl.decode_step(SMOL, 0, 4, 2)


def test_max_batch_size_agrees_with_the_engines_pool(tiny_llama):
    tiny_llama_path = tiny_llama[0]
    from minipaged import LLM

    llm = LLM(tiny_llama_path, kv_cache_bytes=200_000, block_size=16, max_num_seqs=1000,
              num_cpu_blocks=0, max_model_len=64)
    engine = llm.llm_engine
    dims = ModelShape.from_hf(engine.hf_config)
    per_token = dims.kv_bytes_per_token(4)
    assert engine.block_manager.get_num_free_gpu_blocks() == 200_000 // (16 * per_token)
    assert rl.max_batch_size(200_000, per_token, 16, 64) == (
        engine.block_manager.get_num_free_gpu_blocks() // 4)


def test_gpu_budget_is_the_share_less_the_profiled_peak():
    assert rl.gpu_kv_budget(80e9, 0.9, 20e9) == pytest.approx(52e9)
    assert rl.gpu_kv_budget(10e9, 0.5, 6e9) == 0.0


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_counted_flops_match_the_instrumented_engine(kind, tiny_llama, tiny_gpt2):
    """The FLOPs decode_step counts are those the engine's linear layers and attention do."""
    from minipaged import LLM

    path = (tiny_llama if kind == "llama" else tiny_gpt2)[0]
    llm = LLM(path, num_gpu_blocks=64, num_cpu_blocks=0, max_model_len=128)
    dims = ModelShape.from_hf(llm.llm_engine.hf_config)
    prompts = [[5, 6, 7, 8, 9]] * 3
    measured = decode_step_breakdown(llm, prompts, num_steps=2)
    # timed steps attend to 7 and 8 tokens: the mean is that of 7.5
    expected = (rl.decode_step(dims, 3, 7, 4).flops + rl.decode_step(dims, 3, 8, 4).flops) / 2
    assert measured["flops"] == pytest.approx(expected, rel=1e-9)


def test_probes_and_sweep_return_sane_numbers(tiny_llama):
    tiny_llama_path = tiny_llama[0]
    from minipaged import LLM

    assert rl.measure_bandwidth(mib=8, repeats=2) > 1e8
    assert rl.measure_matmul_peak(n=256, repeats=2) > 1e8
    llm = LLM(tiny_llama_path, num_gpu_blocks=64, num_cpu_blocks=0, max_model_len=128)
    rows = rl.decode_sweep(llm, [1, 4], prompt_len=4, num_steps=2)
    assert [r["batch_size"] for r in rows] == [1, 4]
    assert all(r["tokens_per_s"] == r["batch_size"] / r["step_seconds"] > 0 for r in rows)
    assert not llm.llm_engine.has_unfinished_requests()
    assert rl.prefill_step_seconds(llm, 16, repeats=1) > 0
    assert rl.count_torch_ops(lambda: torch.ones(3) + 1) >= 2


def test_decode_run_counts_schedules_and_the_time_outside_the_model(tiny_llama):
    """Lesson 15's multi-step comparison: the same tokens, k steps per schedule."""
    from minipaged import LLM

    runs = {k: rl.decode_run(LLM(tiny_llama[0], num_gpu_blocks=64, max_model_len=128,
                                 num_scheduler_steps=k), 3, 13) for k in (1, 4)}
    assert runs[1]["tokens"] == runs[4]["tokens"] and len(runs[1]["tokens"]) == 3
    assert all(len(t) == 13 for t in runs[1]["tokens"].values())
    assert (runs[1]["steps"], runs[1]["schedules"], runs[4]["schedules"]) == (12, 12, 3)
    assert all(0 < r["outside_s"] < r["step_s"] for r in runs.values())


def test_saturation_batch_is_where_tokens_per_s_reaches_most_of_its_best():
    assert rl.saturation_batch([1, 2, 4, 8, 16], [10, 19, 35, 50, 52]) == 8
    assert rl.saturation_batch([1, 2, 4], [10, 30, 28]) == 2
    assert math.isclose(rl.decode_step(SMOL, 2, 3, 4).bytes,
                        SMOL.weight_params * 4 + 2 * 3 * SMOL.kv_bytes_per_token(4))


def test_roofline_drawing_has_both_ceilings_every_point_and_a_title_that_fits():
    import xml.etree.ElementTree as ET

    from visualizer.roofline import render_roofline

    m = rl.Machine("m", peak_flops=20e9, bandwidth=5e9)
    points = [("decode B=1", 0.5, 0.8e9), ("decode B=64", 29.0, 5e9), ("prefill", 52.0, 9e9)]
    title = "this machine's roofline: engine steps placed on it"
    root = ET.fromstring(render_roofline(m, points, title=title))
    classes = [e.get("class") for e in root.iter()]
    assert classes.count("ceiling") == 2 and classes.count("point") == 3
    assert classes.count("legend-entry") == 5
    assert len({e.get("fill") for e in root.iter() if e.tag.endswith("circle")}) == 3  # distinct
    assert 10 + 0.6 * 13 * len(title) <= float(root.get("width"))
    xs = {e.get("data-name"): float(e.get("data-x"))
          for e in root.iter() if e.get("class") == "point"}
    assert xs == {"decode B=1": 0.5, "decode B=64": 29.0, "prefill": 52.0}
    with pytest.raises(ValueError, match="points"):
        render_roofline(m, [])
