"""Cost checks of the build track (exercises/cost.py): a correct component whose cost grows where
the package's does not gets a verdict naming the operation; the package's own components and
correct learners' ones never do, on a busy machine too."""
import multiprocessing
import time

import pytest

from minipaged.core.allocator import FreeListAllocator
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.prefix_caching_allocator import PrefixCachingAllocator
from minipaged.exercises.answers.lesson02 import MyFreeListAllocator
from minipaged.exercises.answers.lesson03 import MyBlockSpaceManager
from minipaged.exercises.answers.lesson08 import prepare_inputs as answer_prepare_inputs
from minipaged.exercises.answers.lesson11 import MyPrefixCachingAllocator
from minipaged.exercises.cost import PROBES, measure_cost


class CountsByScanning(MyFreeListAllocator):
    """Correct, but counts its free blocks by walking the whole pool."""

    def get_num_free_blocks(self):
        return sum(1 for block in self.blocks if block.ref_count == 0)


class ChecksMembershipOnFree(MyFreeListAllocator):
    """Correct, but tests that a block is not on the free list before pushing it (a list scan)."""

    def free(self, block):
        super().free(block)
        if block.ref_count == 0 and self.stack.count(block) > 1:
            raise ValueError("double free")


class TakesFromTheFront(MyFreeListAllocator):
    """Correct (the same order of blocks), but keeps the free list front-first: pop(0)."""

    def __init__(self, device, block_size, num_blocks):
        super().__init__(device, block_size, num_blocks)
        self.queue = list(self.blocks)

    def allocate(self):
        if not self.queue:
            raise ValueError("no free block")
        block = self.queue.pop(0)
        block.ref_count = 1
        return block

    def free(self, block):
        if block.ref_count <= 0:
            raise ValueError("free already")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.queue.insert(0, block)

    def get_num_free_blocks(self):
        return len(self.queue)


class RefCountsFromTables(MyBlockSpaceManager):
    """Correct, but frees a sequence after counting every table's references to its blocks."""

    def free(self, seq):
        table = self.block_tables.get(seq.seq_id, [])
        for block in table:
            sum(block in other for other in self.block_tables.values())
        super().free(seq)


def pads_each_table_to_the_widest(seq_runs, block_size, device, drafts=None):
    """A learner's prepare_inputs, correct, that finds the widest table again for every row."""
    import torch

    from minipaged.exercises.answers.lesson08 import prepare_inputs

    inputs = prepare_inputs(seq_runs, block_size, device, drafts)
    tables = [run.block_table for run in seq_runs if not run.is_prompt]
    padded = [t + [0] * (max(len(u) for u in tables) - len(t)) for t in tables]
    inputs.meta.block_tables = torch.tensor(padded, dtype=torch.int32)
    return inputs


class CountsFreeByScanning(MyBlockSpaceManager):
    def get_num_free_gpu_blocks(self):
        return sum(1 for block in self.gpu_allocator.blocks if block.ref_count == 0)


@pytest.mark.parametrize("name,slow,operation", [
    ("FreeListAllocator", CountsByScanning, "get_num_free_blocks"),
    ("FreeListAllocator", ChecksMembershipOnFree, "allocate + free"),
    ("FreeListAllocator", TakesFromTheFront, "allocate + free"),
    ("BlockSpaceManager", RefCountsFromTables, "+ free"),
    ("BlockSpaceManager", CountsFreeByScanning, "get_num_free_gpu_blocks"),
    ("prepare_inputs", pads_each_table_to_the_widest, "prepare_inputs"),
])
def test_a_cost_that_grows_with_the_pool_gets_a_verdict_naming_the_operation(name, slow,
                                                                                 operation):
    verdict = measure_cost(name, slow)
    assert verdict.slow, verdict.message()
    message = verdict.message()
    assert message.startswith(f"⚠ {name}: correct, but ")
    assert operation in message.split("): ")[1] and "slower than the package's at" in message
    assert "grows faster with the number of" in message


CORRECT = [("FreeListAllocator", FreeListAllocator), ("FreeListAllocator", MyFreeListAllocator),
           ("BlockSpaceManager", BlockSpaceManager), ("BlockSpaceManager", MyBlockSpaceManager),
           ("PrefixCachingAllocator", PrefixCachingAllocator),
           ("PrefixCachingAllocator", MyPrefixCachingAllocator),
           ("prepare_inputs", None), ("prepare_inputs", answer_prepare_inputs)]


@pytest.mark.parametrize("name,component", CORRECT)
def test_no_false_alarm_on_correct_components(name, component):
    if component is None:  # the package's own function
        from minipaged.exercises import workbench

        component = workbench.component(name).package_object()
    verdict = measure_cost(name, component)
    assert not verdict.slow, verdict.message()
    assert verdict.message().startswith("  cost: at most")


def _spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.slow
@pytest.mark.parametrize("name,component", CORRECT[:4] + CORRECT[-1:])
def test_no_false_alarm_while_both_cores_are_busy(name, component):
    busy = [multiprocessing.Process(target=_spin, args=(60,), daemon=True) for _ in range(2)]
    for process in busy:
        process.start()
    try:
        for _ in range(3):
            verdict = measure_cost(name, component)
            assert not verdict.slow, verdict.message()
    finally:
        for process in busy:
            process.terminate()
            process.join()


def test_a_component_without_a_probe_gets_none():
    assert measure_cost("softmax_phase_cuda", object()) is None
    assert set(PROBES) >= {"FreeListAllocator", "BlockSpaceManager", "PrefixCachingAllocator",
                           "prepare_inputs"}


def test_a_slow_component_is_told_quickly():
    start = time.perf_counter()
    measure_cost("FreeListAllocator", CountsByScanning)
    assert time.perf_counter() - start < 30  # (a busy machine: generous)


def test_a_passing_check_prints_the_cost_and_keeps_a_slow_verdict(tmp_path, monkeypatch, capsys):
    from minipaged.exercises import cost, workbench

    monkeypatch.setenv("MINIPAGED_COST_CHECKS", "1")
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path))
    slow = workbench.check_component("FreeListAllocator", CountsByScanning, num_cases=20)
    assert slow.passed  # correct: it passes, is saved and plugged in
    out = capsys.readouterr().out
    assert "✓ FreeListAllocator: all 20 random cases pass" in out
    assert "⚠ FreeListAllocator: correct, but " in out and "get_num_free_blocks" in out
    kept = cost.recorded(tmp_path, ["FreeListAllocator"])
    assert kept["FreeListAllocator"].startswith("⚠ FreeListAllocator: correct, but ")

    fixed = workbench.check_component("FreeListAllocator", MyFreeListAllocator, num_cases=20)
    assert fixed.passed
    assert "  cost: at most" in capsys.readouterr().out
    assert cost.recorded(tmp_path) == {}  # the fixed one's verdict replaced the slow one's


def test_the_switch_turns_cost_checks_off(tmp_path, monkeypatch, capsys):
    from minipaged.exercises import workbench

    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path))
    workbench.check_component("FreeListAllocator", CountsByScanning, num_cases=10)
    assert "⚠" not in capsys.readouterr().out and "cost:" not in capsys.readouterr().out


def test_each_probe_measures_against_the_components_own_package_object():
    import importlib

    from minipaged.exercises import workbench

    for name, probe in PROBES.items():
        module, _, attribute = probe.package.partition(":")
        assert getattr(importlib.import_module(module), attribute) is \
            workbench.component(name).package_object(), name
