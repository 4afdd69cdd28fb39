"""The KV bytes of a request with and without KV cache groups (``lab/hybrid_kv.py``): the real
Gemma 3 270M's numbers of issue 57, and the formula against the engine's own blocks."""
import pytest

from minipaged import SamplingParams
from minipaged.engine.llm_engine import LLMEngine
from minipaged.lab.hybrid_kv import (gemma3_270m_windows, group_blocks, kv_bytes_per_request,
                                     requests_held)
from minipaged.lab.tiny_families import save_tiny

MiB = 2 ** 20


def test_gemma3_270m_bytes_per_request():
    args = (gemma3_270m_windows(), 1, 256, 2)  # 1 kv head of 256, bfloat16
    every = {n: kv_bytes_per_request(*args, n, hybrid=False) for n in (4096, 32768)}
    hybrid = {n: kv_bytes_per_request(*args, n) for n in (4096, 32768)}
    assert every == {4096: 72 * MiB, 32768: 576 * MiB}
    # 3 full layers keep every token, 15 sliding ones 33 blocks of 16 (a 512-token window)
    assert hybrid[4096] == (3 * 4096 + 15 * 33 * 16) * 2 * 256 * 2
    assert round(hybrid[4096] / MiB) == 20 and round(hybrid[32768] / MiB) == 104
    assert every[4096] / hybrid[4096] == pytest.approx(3.65, abs=0.01)
    held = requests_held(1024 * MiB, *args, 4096)
    assert held == {"every block": 14, "hybrid, held": 51, "hybrid, admitted one by one": 49}


def test_group_blocks():
    assert group_blocks(None, 33, 16) == 3
    assert group_blocks(512, 100, 16) == 7 and group_blocks(512, 4096, 16) == 33
    assert group_blocks(16, 4096, 4) == 5  # ceil(15 / 4) + 1
    # one kind of layer: the two ways agree
    assert kv_bytes_per_request((None,) * 4, 2, 16, 4, 100, 4) == \
        kv_bytes_per_request((None,) * 4, 2, 16, 4, 100, 4, hybrid=False)


def test_the_formula_is_what_the_engine_holds(tmp_path):
    """A request decoding to 100 tokens in the tiny Gemma 3 (window 16, blocks of 4): its full
    group holds a block per 4 tokens, each sliding group at most ``group_blocks``' 5 (4 when
    its window starts a block), as the formula counts it."""
    save_tiny("gemma3", tmp_path, seed=2)
    engine = LLMEngine(str(tmp_path), kv_cache_groups=True, block_size=4, num_gpu_blocks=40,
                       max_model_len=128, dtype="float32", enable_prefix_caching=False)
    manager = engine.scheduler.block_manager
    engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=70, ignore_eos=True),
                       prompt_token_ids=list(range(3, 43)))
    sliding = set()
    for _ in range(61):  # the prompt's step, then 60 decodes: 100 tokens computed
        engine.step()
        (seq_id,) = manager.block_tables
        sliding |= {g.num_held_blocks(g.seqs[seq_id]) for g in manager.groups}
    seq = manager.seqs[seq_id]
    assert seq.get_len() == 101 and seq.num_computed_tokens == 100
    assert len(manager.block_tables[seq_id]) == group_blocks(None, 100, 4) == 25
    assert max(sliding) == group_blocks(16, 100, 4) == 5 and sliding == {4, 5}


def test_group_rows_draw_one_row_per_group(tmp_path):
    """``group_rows``: lesson 20's picture of one sequence's tables, a row per group; the
    sliding row's blocks before the window are dropped (-1), and the drawing names them."""
    from minipaged.lab.hybrid_kv import group_rows
    from visualizer import render_block_tables

    save_tiny("gemma3", tmp_path, seed=2)
    engine = LLMEngine(str(tmp_path), block_size=4, num_gpu_blocks=40, max_model_len=64,
                       dtype="float32", enable_prefix_caching=False)
    manager = engine.scheduler.block_manager
    engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       prompt_token_ids=list(range(3, 11)))
    for _ in range(21):  # 28 tokens: the window of 16 left the first three blocks
        engine.step()
    (seq_id,) = manager.block_tables
    snap = group_rows(manager.snapshot(), seq_id, groups=(0, 1))
    full, sliding = snap["sequences"]
    assert full["block_table"] == manager.get_block_table(manager.seqs[seq_id])
    assert sliding["block_table"][:3] == [-1, -1, -1] and min(sliding["block_table"][3:]) >= 0
    assert (full["request_id"], sliding["request_id"]) == ("full group", "window 16")
    owners = {b["block_number"]: b["owners"] for b in snap["gpu_blocks"] if b["owners"]}
    assert all(owners[n] == [1] for n in sliding["block_table"][3:])
    assert all(owners[n] == [0] for n in full["block_table"])
    drawn = render_block_tables(snap)
    assert "window 16" in drawn
    assert drawn.count("#-1 dropped") == 3  # (the entries before the window, no fill count)
