"""The lessons' measuring helpers (minipaged/lab/measuring.py, tiny_families.save_random,
visualizer.block_tables.block_tables_of): each does what the cell it came from did inline."""
import asyncio
import json
import os
import time
from types import SimpleNamespace

import pytest

from minipaged.lab import measuring
from minipaged.lab.tiny_families import save_random
from visualizer.block_tables import block_tables_of


def test_timed_returns_the_result_and_the_seconds_it_took():
    result, seconds = measuring.timed(lambda: time.sleep(0.02) or "done")
    assert result == "done" and 0.015 < seconds < 5


def test_mean_ms_warms_up_once_then_averages_the_repeats():
    calls = []
    ms = measuring.mean_ms(lambda: calls.append(1), repeats=3)
    assert len(calls) == 4 and ms >= 0
    with pytest.raises(ValueError, match="repeats"):
        measuring.mean_ms(lambda: None, repeats=0)


def test_median_is_the_middle_value():
    assert measuring.median([3, 1, 2]) == 2
    assert measuring.median([4, 1, 3, 2]) == 3  # the upper middle, as lesson 12's cell took it
    with pytest.raises(ValueError, match="no values"):
        measuring.median([])


class _Engine:
    """Three steps, each telling the observers its number."""

    def __init__(self):
        self.left, self.observers = 3, []

    def add_observer(self, fn):
        self.observers.append(fn)

    def remove_observer(self, fn):
        self.observers.remove(fn)

    def has_unfinished_requests(self):
        return self.left > 0

    def step(self):
        self.left -= 1
        for fn in self.observers:
            fn(SimpleNamespace(step=3 - self.left, num_batched_tokens=1))


def test_run_observed_steps_to_the_end_and_keeps_every_snapshot():
    engine = _Engine()
    snapshots = measuring.run_observed(engine)
    assert [s.step for s in snapshots] == [1, 2, 3]
    assert engine.observers == [] and not engine.has_unfinished_requests()


def test_timed_steps_gives_each_step_its_own_seconds():
    engine = _Engine()

    def chat(messages, sampling, use_tqdm):
        while engine.has_unfinished_requests():
            time.sleep(0.01)
            engine.step()

    steps = measuring.timed_steps(SimpleNamespace(llm_engine=engine, chat=chat), [], None)
    assert [snap.step for _, snap in steps] == [1, 2, 3]
    assert all(0.005 < s < 5 for s, _ in steps) and engine.observers == []


def test_run_coroutine_works_beside_a_running_loop_and_raises_its_error():
    async def answer():
        await asyncio.sleep(0)
        return 42

    async def broken():
        raise KeyError("no such client")

    async def inside_a_loop():  # as in Jupyter, where asyncio.run refuses to start
        return measuring.run_coroutine(answer)

    assert asyncio.run(inside_a_loop()) == 42
    with pytest.raises(KeyError, match="no such client"):
        measuring.run_coroutine(broken)


def test_save_random_saves_a_loadable_config_and_leaves_nothing_behind():
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    folder = save_random(config, prefix="test_save_random_")
    path = folder.name
    assert os.path.basename(path).startswith("test_save_random_")
    saved = json.loads(open(os.path.join(path, "config.json")).read())
    assert saved["hidden_size"] == 16 and saved["architectures"] == ["LlamaForCausalLM"]
    folder.cleanup()
    assert not os.path.exists(path)


def test_block_tables_of_reads_each_sequences_table():
    snapshot = SimpleNamespace(block_manager={"sequences": [
        {"seq_id": 0, "block_table": [3, 1]}, {"seq_id": 2, "block_table": []}]})
    assert block_tables_of(snapshot) == {0: [3, 1], 2: []}
