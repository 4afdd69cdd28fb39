"""The build track's components of lessons 02, 03, 04 and 09 (``FreeListAllocator``,
``BlockSpaceManager``, ``Scheduler``, ``admit_waiting``): the reference answers pass their
checkers, wrong components are caught at their first failing case with a hint, unanswered stubs
say "not done", the answers plugged into the real engine change no token, and a saved answer
comes back through ``workbench.collect``.
"""
from __future__ import annotations

import inspect
import random

import pytest

from minipaged import LLM, SamplingParams
from minipaged.exercises import lesson02, lesson03, lesson04, lesson09, workbench
from minipaged.exercises.answers import lesson02 as a02
from minipaged.exercises.answers import lesson03 as a03
from minipaged.exercises.answers import lesson04 as a04
from minipaged.exercises.answers import lesson09 as a09
from minipaged.exercises.checking import SOLUTIONS_ENV
from minipaged.sequence import SequenceStatus

ANSWERS = {"FreeListAllocator": a02.MyFreeListAllocator,
           "BlockSpaceManager": a03.MyBlockSpaceManager,
           "Scheduler": a04.MyScheduler,
           "admit_waiting": a09.admit_waiting}
STUBS = {"FreeListAllocator": lesson02.MyFreeListAllocator,
         "BlockSpaceManager": lesson03.MyBlockSpaceManager,
         "Scheduler": lesson04.MyScheduler,
         "admit_waiting": lesson09.admit_waiting}


@pytest.fixture(autouse=True)
def learner_dir(tmp_path, monkeypatch):
    """Saved components go to a folder of the test's own."""
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path / "learner"))
    return tmp_path / "learner"


def check(name, candidate, **kwargs):
    return workbench.check_component(name, candidate, save=False, **kwargs)


# -- the answers pass, the stubs are not done ---------------------------------------------------
@pytest.mark.parametrize("name", list(ANSWERS))
def test_the_reference_answer_passes_its_checker(name):
    result = check(name, ANSWERS[name])
    assert result.status == "passed", result
    assert workbench.component(name).solution_object() is ANSWERS[name]


@pytest.mark.parametrize("name", list(STUBS))
def test_the_unanswered_stub_says_not_done(name, monkeypatch):
    assert check(name, STUBS[name]).status == "not done"
    monkeypatch.setenv(SOLUTIONS_ENV, "1")
    result = check(name, STUBS[name])
    assert result.status == "solution used" and "reference answer" in result


@pytest.mark.parametrize("name", list(ANSWERS))
def test_a_saved_answer_comes_back_through_collect_and_passes(name, learner_dir):
    path = workbench.save_component(name, ANSWERS[name])
    assert path == learner_dir / f"{name}.py"
    found, missing = workbench.collect([name])
    assert not missing and found[name] is not ANSWERS[name]
    assert check(name, found[name], num_cases=40).status == "passed"


def test_a_passing_check_saves_the_component_for_the_capstone(learner_dir):
    result = workbench.check_component("FreeListAllocator", a02.MyFreeListAllocator, num_cases=20)
    assert result.passed and (learner_dir / "FreeListAllocator.py").exists()
    assert workbench.passed("FreeListAllocator") is a02.MyFreeListAllocator


def test_the_reference_answers_are_real_components():
    """Lines of each answer (the brief: three of the four at least 20)."""
    lines = {name: len(inspect.getsource(obj).splitlines()) for name, obj in ANSWERS.items()}
    assert sum(n >= 20 for n in lines.values()) >= 3, lines
    assert lines["BlockSpaceManager"] >= 60 and lines["Scheduler"] >= 60, lines


# -- wrong components are caught at their first failing case, with a hint ------------------------
class AllocatorThatNeverFrees(a02.MyFreeListAllocator):
    def free(self, block):
        pass


class AllocatorWithoutRefCounts(a02.MyFreeListAllocator):
    def free(self, block):
        if block.ref_count == 0:
            raise ValueError("free")
        block.ref_count = 0
        self.stack.append(block)


class AllocatorThatFreesAnything(a02.MyFreeListAllocator):
    def free(self, block):
        block.ref_count -= 1
        if block.ref_count == 0:
            self.stack.append(block)


class ManagerWritingIntoSharedBlocks(a03.MyBlockSpaceManager):
    def append_slot(self, seq):
        table = self.tables[seq.seq_id]
        if len(table) < len(seq.logical_token_blocks):
            return super().append_slot(seq)
        self._emit("append", seq_id=seq.seq_id, block=table[-1].block_number, new_block=False)
        return None


class ManagerThatKeepsRefCounts(a03.MyBlockSpaceManager):
    def free(self, seq):
        table = self.tables.pop(seq.seq_id, None)
        if table is not None:
            self.holders.pop(seq.seq_id)
            self._emit("free", seq_id=seq.seq_id, blocks=[b.block_number for b in table])


class ManagerForkingWithoutReferences(a03.MyBlockSpaceManager):
    def fork(self, parent, child):
        self.tables[child.seq_id] = list(self.tables[parent.seq_id])
        self.holders[child.seq_id] = (child, self.holders[parent.seq_id][1])
        self._emit("fork", parent=parent.seq_id, child=child.seq_id,
                   blocks=self.get_block_table(child))


class ManagerWithoutWatermark(a03.MyBlockSpaceManager):
    def can_allocate(self, seq_group):
        seqs, _, _ = self.prompt_layout(seq_group)
        return self.gpu_allocator.get_num_free_blocks() >= len(seqs[0].logical_token_blocks)


class SchedulerThatForgetsTheSwappedQueue(a04.MyScheduler):
    def _resume_swapped(self, step):
        pass


class SchedulerThatAlwaysSwaps(a04.MyScheduler):
    def _preempt(self, seq_group, blocks_to_swap_out):
        forced = self.forced_mode
        self.forced_mode = forced or lesson04.PreemptionMode.SWAP
        try:
            return super()._preempt(seq_group, blocks_to_swap_out)
        finally:
            self.forced_mode = forced


class SchedulerPreemptingTheNeedy(a04.MyScheduler):
    """Preempts the group that needs the room instead of the newest one."""

    def _schedule_running(self, step):
        self.running.sort(key=lambda g: g.arrival_time)
        queue, self.running = self.running, []
        for seq_group in queue:
            if seq_group.pending_chunks:
                self.running.append(seq_group)
            elif not self.block_manager.can_append_slot(seq_group):
                step.preempted.append(self._preempt(seq_group, step.blocks_to_swap_out))
            else:
                self._append_slots(seq_group, step.blocks_to_copy)
                self.running.append(seq_group)
                step.decode_groups.append(seq_group)
                step.budget -= seq_group.num_seqs(SequenceStatus.RUNNING)


def _answer_with(old: str, new: str):
    """lesson 09's answer with one line changed (a wrong admission)."""
    source = inspect.getsource(a09)
    assert old in source
    namespace: dict = {}
    exec(compile(source.replace(old, new), "wrong_admission", "exec"), namespace)
    return namespace["admit_waiting"]


ADMITS_WHILE_SWAPPED = _answer_with("if self.swapped or step.preempted", "if step.preempted")
IGNORES_MAX_NUM_SEQS = _answer_with("> self.config.max_num_seqs)", "> 10**9)")
SKIPS_THE_BUDGET = _answer_with("if step.budget < needed or too_many", "if too_many")

WRONG = [
    ("FreeListAllocator", AllocatorThatNeverFrees, "case 0 fails",
     ["free(block 0)", "'get_num_free_blocks()': 6", "'get_num_free_blocks()': 7",
      "free() drops ONE reference"]),
    ("FreeListAllocator", AllocatorWithoutRefCounts, "case 2 fails",
     ["acquire(block 0)", "free(block 0)", "'ref counts': [0, 1", "'ref counts': [1, 1",
      "free() drops ONE reference"]),
    ("FreeListAllocator", AllocatorThatFreesAnything, "case 1 fails",
     ["which is free) -> ValueError", "yours:    'no error'", "cannot be freed again"]),
    ("BlockSpaceManager", ManagerWritingIntoSharedBlocks, "case 0 fails",
     ["step 5: schedule()", "copy_on_write", "'new_block': False",
      "who else holds that block?"]),
    ("BlockSpaceManager", ManagerThatKeepsRefCounts, "case 0 fails",
     ["free(seq 4)", "has ref count 2, but 1 block tables hold it", "loses one reference"]),
    ("BlockSpaceManager", ManagerForkingWithoutReferences, "case 0 fails",
     ["fork(seq 3 -> seq 4)", "has ref count 1, but 2 block tables hold it",
      "held by one table more"]),
    ("BlockSpaceManager", ManagerWithoutWatermark, "case 1 fails",
     ["watermark 0.15", "'op': 'allocate'", "keep watermark_blocks free"]),
    ("Scheduler", SchedulerThatForgetsTheSwappedQueue, "case 2 fails",
     ["'swapped': ['2']", "yours:    {'blocks_to_swap_in': {}}",
      "expected: {'blocks_to_swap_in': {0: 3}}", "swapped groups come back"]),
    ("Scheduler", SchedulerThatAlwaysSwaps, "case 2 fails",
     ["preemption by group size", "[('1', 'swap')]", "[('1', 'recompute')]", "wrong mode"]),
    ("Scheduler", SchedulerPreemptingTheNeedy, "case 0 fails",
     ["'preempted'", "newest group"]),
    ("admit_waiting", ADMITS_WHILE_SWAPPED, "case 7 fails",
     ["'swapped': ['3']", "yours:    {'scheduled': [('4', 'prompt')",
      "nothing new is admitted while a group is swapped out"]),
    ("admit_waiting", IGNORES_MAX_NUM_SEQS, "case 3 fails",
     ["max_num_seqs 4", "[('2', 'prompt')", "max_num_seqs bounds"]),
    ("admit_waiting", SKIPS_THE_BUDGET, "case 11 fails",
     ["max_num_batched_tokens 5", "room for its first chunk"]),
]


@pytest.mark.parametrize("name, wrong, case, parts", WRONG,
                         ids=[w[1].__name__ if inspect.isclass(w[1]) else w[1].__code__.co_filename
                              for w in WRONG])
def test_a_wrong_component_is_caught_at_its_first_failing_case(name, wrong, case, parts):
    result = check(name, wrong)
    assert result.status == "failed" and f"✗ {name}: {case}" in result, result
    for part in parts:
        assert part in result, (part, str(result))
    assert "hint: " in result and "Traceback" not in result
    assert "_check" not in result  # no line of the checker's own source


# -- plugged into the real engine, the answers change no token ------------------------------------
PROMPTS = [[12, 40, 41, 99, 7, 150, 3], [5, 6, 7], [200] * 9, [77, 78, 79, 80, 81]]


def _generate(path, mode):
    """Parallel sampling and greedy requests in a pool small enough to preempt."""
    llm = LLM(path, block_size=4, num_gpu_blocks=12, num_cpu_blocks=24, max_model_len=48,
              preemption_mode=mode, max_num_batched_tokens=16, enable_prefix_caching=False)
    params = [SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=3, temperature=0.7, seed=5, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    stats = llm.llm_engine.stats
    return ([[o.token_ids for o in r.outputs] for r in outs],
            stats.num_preemptions_swap + stats.num_preemptions_recompute)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_the_answers_plugged_into_the_engine_change_no_token(tiny_llama, mode):
    path, _ = tiny_llama
    expected, preemptions = _generate(path, mode)
    assert preemptions > 0
    for name, answer in ANSWERS.items():
        with workbench.plugged_in(objects={name: answer}):
            got, _ = _generate(path, mode)
        assert got == expected, name


def test_plugged_in_puts_each_answer_where_the_package_looks():
    from minipaged.core import block_manager, scheduler
    from minipaged.engine import cache_setup
    from minipaged.lab import dry_run
    package_scheduler, package_admit = scheduler.Scheduler, scheduler.Scheduler._admit_waiting
    with workbench.plugged_in(objects=ANSWERS):
        run = dry_run.DryRun(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4)
        assert isinstance(run.block_manager, a03.MyBlockSpaceManager)
        assert isinstance(run.block_manager.gpu_allocator, a02.MyFreeListAllocator)
        assert isinstance(run.block_manager.cpu_allocator, a02.MyFreeListAllocator)
        assert isinstance(run.scheduler, a04.MyScheduler)
        assert cache_setup.Scheduler is a04.MyScheduler
        assert scheduler.Scheduler._admit_waiting is a09.admit_waiting
        assert block_manager.FreeListAllocator is a02.MyFreeListAllocator
    assert scheduler.Scheduler is package_scheduler
    assert scheduler.Scheduler._admit_waiting is package_admit
    assert block_manager.FreeListAllocator.__module__ == "minipaged.core.allocator"


def test_the_checkers_cover_preemption_swapping_and_copy_on_write():
    """The random workloads reach what the components are about."""
    seen = {"copy_on_write": 0, "swap_out": 0, "swap_in": 0, "preempt": 0, "fork": 0}
    steps = lesson04._lockstep_steps(lesson04.Scheduler, random.Random(0), 60)
    for _, _, _, theirs, _, _ in steps:
        for event in theirs.events:
            if event["op"] in seen:
                seen[event["op"]] += 1
        theirs.events.clear()
    assert seen["preempt"] > 20 and seen["swap_out"] > 5 and seen["swap_in"] > 5, seen
    assert seen["copy_on_write"] > 5, seen
