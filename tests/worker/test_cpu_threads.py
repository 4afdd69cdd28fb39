"""The threads a CPU step runs with (worker/cpu_threads.py): the machine's load read from a
/proc/stat, the choice by the step's size and the free cores, when torch's count changes, the
setting that pins it, and the engine's outputs unchanged by any of it."""
import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.worker import cpu_threads
from minipaged.worker.cpu_threads import CpuLoad, ThreadChooser


class FakeMachine:
    """A /proc/stat with two cores, a wall clock and this process's CPU time, all advanced by
    hand: ``run(seconds, others=cores kept busy by other programs, mine=cores we used)``."""

    def __init__(self, tmp_path, steal: bool = False):
        self.path = tmp_path / "stat"
        self.now = 100.0
        self.own = 5.0
        self.busy_ticks = [0, 0]
        self.idle_ticks = [0, 0]
        self.steal = steal
        self.write()

    def write(self):
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        for c in range(2):
            user, steal = (0, self.busy_ticks[c]) if self.steal else (self.busy_ticks[c], 0)
            lines.append(f"cpu{c} {user} 0 0 {self.idle_ticks[c]} 0 0 0 {steal} 0 0")
        lines.append("intr 1 2 3")
        self.path.write_text("\n".join(lines) + "\n")

    def run(self, seconds: float, others: float, mine: float = 0.0):
        ticks = int(round(seconds * 100))
        busy = others + mine
        for c in range(2):
            share = min(1.0, max(0.0, busy - c))
            self.busy_ticks[c] += int(round(ticks * share))
            self.idle_ticks[c] += ticks - int(round(ticks * share))
        self.now += seconds
        self.own += seconds * mine
        self.write()

    def load(self) -> CpuLoad:
        load = CpuLoad(str(self.path), clock=lambda: self.now, own_cpu=lambda: self.own)
        load.cpus = {"cpu0", "cpu1"}
        load.ticks_per_s = 100
        return load


@pytest.mark.parametrize("steal", [False, True], ids=["other programs", "stolen by the host"])
@pytest.mark.parametrize("others,mine", [(0.0, 0.0), (1.0, 0.0), (1.0, 1.0), (2.0, 0.0),
                                         (0.0, 2.0), (0.5, 1.5)])
def test_the_load_counts_other_programs_only(tmp_path, others, mine, steal):
    machine = FakeMachine(tmp_path, steal)
    load = machine.load()
    load.others()
    machine.run(1.0, others, mine)
    assert load.others() == pytest.approx(others, abs=0.02)


def test_the_load_is_averaged_over_half_a_second_or_more(tmp_path):
    machine = FakeMachine(tmp_path)
    load = machine.load()
    load.others()
    machine.run(0.1, others=2.0)
    assert load.others() == 0.0  # too short a window yet: the last estimate (none) stands
    for _ in range(10):
        machine.run(0.1, others=1.0)
        load.others()
    # the busy first tenth has left the window: what stays is the last half second or more
    assert load.others() == pytest.approx(1.0, abs=0.05)


def test_without_a_proc_stat_the_machine_counts_as_quiet(tmp_path):
    load = CpuLoad(str(tmp_path / "missing"))
    assert load.others() == 0.0


def chooser(tmp_path, setting=None, hidden=576, cores=2):
    machine = FakeMachine(tmp_path)
    return machine, ThreadChooser(setting, hidden, load=machine.load(), cores=cores)


@pytest.mark.parametrize("tokens,others,expected", [
    (1, 0.0, 2),      # one token of a 576-wide model: both cores when they are free
    (4, 0.0, 2),      # a small decode step too
    (4, 1.0, 1),      # ... but not when one core is busy
    (64, 0.0, 2),     # a batch of 64: both cores
    (300, 0.0, 2),    # a prompt: both cores
    (300, 0.4, 2),    # a little load is not a busy core
    (300, 1.0, 1),    # one core busy: only the free one
    (300, 2.0, 1),    # both busy: still one
    (4, 2.0, 1),
])
def test_threads_follow_the_step_and_the_free_cores(tmp_path, tokens, others, expected):
    machine, threads = chooser(tmp_path)
    machine.run(1.0, others)
    assert threads.wanted(tokens) == expected


def test_more_cores_and_a_wider_model(tmp_path):
    machine, threads = chooser(tmp_path, hidden=4096, cores=16)
    machine.run(1.0, 0.0)
    assert threads.wanted(1) == 16
    machine, threads = chooser(tmp_path, hidden=64, cores=16)  # a tiny model
    machine.run(1.0, 0.0)
    assert threads.wanted(1) == 1
    assert threads.wanted(8) == 2
    assert threads.wanted(1000) == 16
    machine.run(1.0, 2.0)  # two cores busy (the fake /proc/stat has two)
    assert threads.wanted(1000) == 14


def test_a_pinned_count_is_kept(tmp_path):
    machine, threads = chooser(tmp_path, setting=2)
    machine.run(1.0, others=2.0)
    assert threads.wanted(1) == 2


@pytest.fixture
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_fewer_threads_at_once_more_only_once_the_choice_stands(tmp_path, keep_torch_threads):
    machine, threads = chooser(tmp_path, hidden=64)  # 4 tokens: one thread; 300: two
    torch.set_num_threads(2)
    machine.run(1.0, 0.0)
    assert threads.before_step(300) == 2
    assert threads.before_step(4) == 1  # fewer: at once
    assert torch.get_num_threads() == 1
    assert [threads.before_step(300) for _ in range(4)] == [1, 1, 2, 2]  # more: the third step
    assert threads.before_step(4) == 1
    assert [threads.before_step(300), threads.before_step(4), threads.before_step(300)] == \
        [1, 1, 1]  # a choice that flickers never rebuilds the pools
    torch.set_num_threads(2)  # somebody else set a count: the next step chooses afresh
    assert threads.before_step(4) == 1
    assert threads.steps_by_threads[1] >= 8


def test_the_setting_is_checked():
    with pytest.raises(ValueError, match="cpu_threads must be None .chosen per step. or an "
                                         "integer >= 1, got 0"):
        LLM(None, cpu_threads=0)


def test_the_engine_chooses_and_generate_gives_the_callers_count_back(tiny_llama,
                                                                      keep_torch_threads):
    path, _ = tiny_llama
    torch.set_num_threads(2)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17]]
    outputs = {}
    for setting in (None, 1, 2):
        llm = LLM(path, device="cpu", dtype="float32", block_size=4, cpu_threads=setting)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        outputs[setting] = [o.outputs[0].token_ids for o in outs]
        assert torch.get_num_threads() == 2
        chosen = llm.llm_engine.worker.threads.steps_by_threads
        assert sum(chosen.values()) == llm.llm_engine.stats.num_steps
        if setting is not None:
            assert set(chosen) == {setting}
        else:  # a tiny model's decode steps (3 x 64 elements) are small: one thread
            assert 1 in chosen and set(chosen) <= {1, 2}
    assert outputs[None] == outputs[1] == outputs[2]


def test_min_elements_per_thread_is_what_the_docstring_says():
    assert 3 * 64 < cpu_threads.MIN_ELEMENTS_PER_THREAD <= 576
