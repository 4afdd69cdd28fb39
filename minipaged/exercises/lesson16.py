"""Lesson 16 exercises: your own engine (the capstone).

Warm-ups (formulas of the scheduler and the flat batch):

    pick_victims(running, num_free) -> (kept, preempted)
        step 1 of ``Scheduler.schedule``: serve the ``RunningGroup``s oldest first; while a
        group's ``blocks_needed`` exceed the free blocks, preempt the NEWEST group not served
        yet (its ``blocks_held`` become free); if none is left, the group itself is preempted.
    step_slot_mapping(seqs, block_size, slot_of) -> list[int]
        the slot of every token of a step's flat batch (``SeqView``s, in any order): the
        prompts' tokens first, then one token per decode.

The build track's component of this lesson, ``LLMEngine.step``: the engine's ``step()``, written
from a stub with its signature and docstring, checked against the package's own step on random
workloads (preemption by recompute and swap, copy-on-write, prefix caching, beam search) after
every step, then plugged into ``LLMEngine``.

The capstone, ``check_capstone()``: the package's engine with every component you wrote in the
build track plugged in (collected by name from where each lesson's check saved it), next to
``LLM()`` on the embedded SmolLM2, compared after every step (``exercises/capstone.py``).
"""
from __future__ import annotations

import itertools
import random
from typing import NamedTuple

import torch

from minipaged.exercises import solutions, workbench
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.exercises.step_hints import STEP_HINTS, observer_hint, sequence_hint, stats_hint
from minipaged.exercises.workbench import Component
from minipaged.lab.batch_inputs import prepare_inputs_for_groups
from minipaged.exercises import capstone
from minipaged.exercises.capstone_runs import (  # noqa: F401 (the lesson reads them from here)
    CAPSTONE_COMPONENTS, PREFIX_SETTINGS, SPECULATIVE_SETTINGS, WIDER_COMPONENTS, capstone_names,
    capstone_runs, kernel_workload, prefix_workload, speculative_workload)
from minipaged.exercises.capstone import (Request, Unfinished, default_workload,
                                          first_difference, new_engine, run_steps)
from minipaged.lab.dry_run import DryRun
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import SequenceStatus

__all__ = ["RunningGroup", "SeqView", "check_pick_victims", "check_step_slot_mapping",
           "check_capstone", "capstone_names", "CAPSTONE_COMPONENTS", "Request",
           "default_workload", "tiny_settings"]


class RunningGroup(NamedTuple):
    """A running group as ``pick_victims`` sees it (oldest first)."""

    request_id: str
    blocks_held: int  # distinct blocks its sequences hold: what preempting it frees
    blocks_needed: int  # blocks its sequences' next tokens take (new blocks and copies)


class SeqView(NamedTuple):
    """A scheduled sequence as ``step_slot_mapping`` sees it (lesson 08's ``SeqView``)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]


# -- random traffic with parallel sampling, preempting by recompute -----------------------------
def _random_steps(rng):
    """(DryRun, the step's scheduler outputs or None) on random traffic with parallel sampling:
    each step is yielded twice, before ``schedule()`` (None) and after it, before the "model"
    runs. Every sequence of a group gets the same tokens, so a group stays alike. Endless."""
    while True:
        block_size = rng.choice([1, 2, 4])
        run = DryRun(block_size, rng.randint(6, 20), preemption_mode="recompute")
        for _ in range(rng.randint(4, 16)):
            for _ in range(rng.choice([0, 1, 1, 2])):
                length = rng.randint(1, 2 * block_size + 1)
                run.add_request([rng.randrange(1000) for _ in range(length)],
                                n=rng.choice([1, 1, 2, 3]))
            yield run, None
            outs = run.scheduler.schedule()
            yield run, outs
            run.sampled(outs)
            for g in list(run.scheduler.running):
                if rng.random() < 0.15:
                    for s in g.get_seqs(SequenceStatus.RUNNING):
                        run.finish(s)


# -- warm-up 1: who is preempted -----------------------------------------------------------------
def _random_running(rng, num_cases):
    """(running groups as RunningGroup, free blocks, the real scheduler's (kept, preempted))."""
    return itertools.islice(_running_cases(rng), num_cases)


def _running_cases(rng):
    before = None
    for run, outs in _random_steps(rng):
        bm = run.block_manager
        if outs is None:
            before = []
            for g in sorted(run.scheduler.running, key=lambda g: g.arrival_time):
                seqs = g.get_seqs(SequenceStatus.RUNNING)
                held = len({id(b) for s in seqs for b in bm.get_blocks(s.seq_id)})
                before.append(RunningGroup(g.request_id, held, bm.num_blocks_to_append(seqs)))
            free = bm.get_num_free_gpu_blocks()
        elif before:
            yield before, free, ([g.request_id for g in outs.decode_seq_groups],
                                 [r for r, _ in outs.preempted])


@exercise
def check_pick_victims(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("pick_victims", fn)
    for case, (running, free, expected) in enumerate(_random_running(rng_for(seed), num_cases)):
        got = learner(list(running), free)
        got = (list(got[0]), list(got[1]))
        if got != expected:
            if sorted(got[1]) == sorted(expected[1]):
                hint = "the right victims in the wrong order: list them as they are preempted"
            elif expected[1] and set(got[1]) != set(expected[1]):
                hint = ("the victim is the newest group that has not been served yet; a group "
                        "already served keeps its blocks")
            else:
                hint = ("a group fits when its blocks_needed are at most the free blocks; a "
                        "victim's blocks_held become free, a kept group's blocks_needed do not")
            fail(learner.name, case, f"running={running}, num_free={free}", got, expected, hint)
    return passed(learner, num_cases)


# -- warm-up 2: the slot mapping of a mixed step -------------------------------------------------
def _random_batches(rng, num_cases):
    """(SeqViews in a random order, block size, the slot mapping of ``prepare_inputs``)."""
    return itertools.islice(_batch_cases(rng), num_cases)


def _batch_cases(rng):
    for run, outs in _random_steps(rng):
        if outs is None or not outs.scheduled_seq_groups:
            continue
        groups = rng.sample(outs.scheduled_seq_groups, len(outs.scheduled_seq_groups))
        views = []
        for g in groups:
            seqs = g.get_seqs(SequenceStatus.RUNNING)
            if seqs[0].num_computed_tokens == 0:  # a prompt: computed once for its sequences
                seqs = seqs[:1]
            views += [SeqView(s.get_token_ids(), s.num_computed_tokens,
                              run.block_manager.get_block_table(s)) for s in seqs]
        batch = prepare_inputs_for_groups(groups, run.block_manager, run.block_size,
                                          torch.device("cpu"))
        yield views, run.block_size, batch.meta.slot_mapping.tolist()


def _show(seqs) -> str:
    return "[" + ", ".join(f"SeqView({len(s.token_ids)} tokens, computed "
                           f"{s.num_computed_tokens}, table {s.block_table})" for s in seqs) + "]"


@exercise
def check_step_slot_mapping(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("step_slot_mapping", fn)
    for case, (seqs, block_size, expected) in enumerate(_random_batches(rng_for(seed),
                                                                        num_cases)):
        got = [int(s) for s in learner(list(seqs), block_size, solutions.slot_of)]
        if got != expected:
            if sorted(got) == sorted(expected):
                hint = "the right slots in the wrong order: the prompt runs come first"
            elif len(got) != len(expected):
                hint = ("one slot per token the step computes: all of a prompt run's tokens, "
                        "only the newest of a decode")
            else:
                hint = ("a token's position is where it stands in its own sequence; its slot "
                        "comes from its own sequence's block table")
            fail(learner.name, case, f"{_show(seqs)}, block_size={block_size}", got, expected,
                 hint)
    return passed(learner, num_cases)


# -- the component: LLMEngine.step ---------------------------------------------------------------
def tiny_settings(block_size: int = 4, num_gpu_blocks: int = 12, num_cpu_blocks: int = 8,
                  enable_prefix_caching: bool = False) -> dict:
    """Engine settings over a tiny random LLaMA (seeded weights): fast enough for many cases."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.2, eos_token_id=1)
    return dict(hf_config=config, load_format="dummy", block_size=block_size,
                num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                max_model_len=min(64, num_gpu_blocks * block_size), max_num_seqs=256,
                watermark=0.0,
                enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=False,
                max_num_batched_tokens=4096, device="cpu", dtype="float32", seed=0,
                cpu_threads=1)


def _fits(prompt_len: int, max_tokens: int, n: int, num_gpu_blocks: int, block_size: int) -> bool:
    """Does a request of ``n`` sequences fit the pool alone (what ``LLM()`` accepts)?"""
    per_seq = -(-(prompt_len + max_tokens) // block_size)
    return n * per_seq <= num_gpu_blocks


def _random_case(rng: random.Random) -> tuple[dict, list[Request]]:
    """Engine settings and a workload: a small pool (preemption by recompute and swap), parallel
    sampling (copy-on-write), seeded top-p, beam search, stops at EOS, prefix caching."""
    block_size = rng.choice([2, 4])
    num_gpu_blocks = rng.randint(8, 14)
    settings = tiny_settings(block_size, num_gpu_blocks, rng.choice([0, 8]),
                             enable_prefix_caching=rng.random() < 0.4)
    shared = [rng.randrange(2, 256) for _ in range(rng.randint(0, 6))]  # a common prefix
    workload = []
    for i in range(rng.randint(2, 5)):
        prompt = shared + [rng.randrange(2, 256) for _ in range(rng.randint(1, 6))]
        max_tokens, n = rng.randint(1, 8), rng.choice([1, 1, 2, 3])
        if not _fits(len(prompt), max_tokens, n, num_gpu_blocks, block_size):
            n, max_tokens = 1, 2
        kind = rng.random()
        if kind < 0.45:
            params = SamplingParams(n=n, temperature=0, max_tokens=max_tokens,
                                    ignore_eos=rng.random() < 0.7)
        elif kind < 0.85:
            params = SamplingParams(n=n, temperature=1.0, top_p=rng.choice([0.5, 0.9, 1.0]),
                                    max_tokens=max_tokens, seed=rng.randrange(100))
        else:
            params = SamplingParams(n=2, use_beam_search=True, temperature=0,
                                    max_tokens=max_tokens, ignore_eos=True)
            if not _fits(len(prompt), max_tokens, 2, num_gpu_blocks, block_size):
                params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        workload.append(Request(prompt, params, rng.randint(0, 3)))
    return settings, workload


def _describe(settings: dict, workload: list[Request]) -> str:
    def params(p: SamplingParams) -> str:
        kind = ("beam search" if p.use_beam_search else "greedy" if p.temperature == 0
                else f"top-p {p.top_p} seed {p.seed}")
        return f"n={p.n} {kind} max_tokens={p.max_tokens}" + ("" if p.ignore_eos else " eos")

    pool = (f"{settings['num_gpu_blocks']} GPU blocks of {settings['block_size']}, "
            f"{settings['num_cpu_blocks']} CPU blocks"
            + (", prefix caching" if settings["enable_prefix_caching"] else ""))
    requests = "; ".join(f"{i}: {len(r.prompt_token_ids)} prompt tokens, {params(r.params)}, "
                         f"arrives before step {r.arrive_at_step + 1}"
                         for i, r in enumerate(workload))
    return f"{pool}; requests {requests}"


def _check_engine_step(candidate, rng: random.Random, num_cases: int) -> int:
    """The package's step and ``candidate`` on the same random workload, compared after every
    step (``capstone.step_state``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is as fast, and steady on a busy CPU
    try:
        for case in range(num_cases):
            settings, workload = _random_case(rng)
            expected = [s.state for s in run_steps(new_engine(settings), workload)]
            engine = new_engine(settings)
            steps = run_steps(engine, workload, max_steps=len(expected) + 3, step=candidate)
            number = 0
            try:
                for number, (_, state, _, _) in enumerate(steps, start=1):
                    theirs = (expected[number - 1] if number <= len(expected) else
                              {**state, "queues": "empty (every request finished)"})
                    found = first_difference(state, theirs)
                    if found:
                        if found.kind == "sequences":
                            request = workload[int(found.expected["request"])]
                            hint = sequence_hint(found.yours, found.expected, request.params)
                        elif found.kind == "stats":
                            hint = stats_hint(found.expected)
                        elif found.kind == "observers":
                            hint = observer_hint(found.field)
                        else:
                            hint = STEP_HINTS[found.kind]
                        fail("LLMEngine.step", case, f"{_describe(settings, workload)}; after "
                             f"step {number}: {found.subject}", found.yours, found.expected,
                             hint)
            except Unfinished:
                fail("LLMEngine.step", case, _describe(settings, workload),
                     f"requests still unfinished after step {number}",
                     f"all finished after step {len(expected)}", STEP_HINTS["queues"])
            if number < len(expected):
                fail("LLMEngine.step", case, _describe(settings, workload),
                     f"every request finished after step {number}",
                     f"finished after step {len(expected)}", STEP_HINTS["queues"])
    finally:
        torch.set_num_threads(threads)
    return num_cases


workbench.register(Component(
    name="LLMEngine.step", lesson="16",
    slots=("minipaged.engine.llm_engine:LLMEngine.step",),
    check=_check_engine_step,
    solution="minipaged.exercises.answers.lesson16:step",
    preamble=("import time\n\n"
              "from minipaged.engine.stats import StepSnapshot\n"
              "from minipaged.exercises.checking import not_done\n"
              "from minipaged.outputs import RequestOutput\n"
              "from minipaged.engine import llm_engine"),
    num_cases=30,
))


# -- the capstone --------------------------------------------------------------------------------
def check_capstone(on_step=None, workload: list[Request] | None = None,
                   settings: dict | None = None, names: list[str] | None = None,
                   max_steps: int = 100) -> CheckResult:
    """Your engine next to ``LLM()`` (``capstone.check_capstone``).

    By default the four runs of ``capstone_runs`` over ``capstone_names()``; given ``names``,
    ``workload`` or ``settings`` (tests), one run of those.
    """
    if names is None and workload is None and settings is None:
        names = capstone_names()
        return capstone.check_capstone(names, on_step, max_steps=max_steps,
                                       runs=capstone_runs(names))
    return capstone.check_capstone(capstone_names() if names is None else list(names), on_step,
                                   workload, settings, max_steps)


# -- wrong steps, for the lesson and the tests ----------------------------------------------------
_SWAP = ("    self.worker.cache_swap(outs.blocks_to_swap_in, outs.blocks_to_swap_out, "
         "outs.blocks_to_copy)\n")
_MODEL = "        logits = self.worker.execute_model(inputs)  # (rows, vocab)\n"
_APPEND = "            seq.append_token_id(out.token_id, out.logprobs)\n"
_STOP = "            self.output_processor.check_stop(seq, seq_group.sampling_params)\n"
_FREE_GROUPS = "    finished = self.scheduler.free_finished_seq_groups()\n"
WRONG_STEPS = {  # what is wrong -> the edits that make the reference answer so
    "the blocks move after the model ran": [(_SWAP, ""), (_MODEL, _MODEL + "    " + _SWAP)],
    "the stop check runs before the token is appended": [(_APPEND + _STOP, _STOP + _APPEND)],
    "finished groups are never freed": [(_FREE_GROUPS, "    finished = []\n")],
    "finished groups are freed before the new tokens are appended": [
        (_FREE_GROUPS, ""),
        ("    inputs = llm_engine.prepare_inputs(",
         _FREE_GROUPS + "    inputs = llm_engine.prepare_inputs(")],
    "finished sequences keep their blocks": [
        ("                self.scheduler.free_seq(seq)  # its blocks go back at once\n",
         "                pass\n")],
    "beams are copied while the tokens are appended": [  # one loop instead of two
        ("        for seq_id, out in new_tokens.items():\n"
         "            seq = seq_group.find(seq_id)\n",
         "            seq = seq_group.find(seq_id)\n")],
    "the observers are told before the finished groups are freed": [
        ("    finished = self.scheduler.free_finished_seq_groups()\n"
         "    for seq_group in finished:\n        self._forget(seq_group)\n"
         "    self.stats.num_steps += 1\n", "    self.stats.num_steps += 1\n"),
        ("            observer(snapshot)\n",
         "            observer(snapshot)\n"
         "    finished = self.scheduler.free_finished_seq_groups()\n"
         "    for seq_group in finished:\n        self._forget(seq_group)\n"),
        ("StepSnapshot.of_step(outs, finished + ended,", "StepSnapshot.of_step(outs, ended,")],
    "the step keeps no counts": [
        ("        self.stats.count_tokens(inputs.meta.num_prompt_tokens,\n"
         "                                inputs.meta.num_generation_tokens, 0)\n", ""),
        ("        self.stats.time_model += time.perf_counter() - start\n", ""),
        ("        self.stats.num_sampled_tokens += sum(len(tokens) for tokens in "
         "sampled.values())\n", "")],
}


def wrong_step(what: str):
    """The reference answer's step with one mistake (a key of ``WRONG_STEPS``)."""
    import inspect

    from minipaged.exercises.answers import lesson16 as answers

    source = inspect.getsource(answers.step)
    for old, new in WRONG_STEPS[what]:
        if old not in source:
            raise ValueError(f"wrong_step: {old!r} is not in the answer any more")
        source = source.replace(old, new, 1)
    namespace = dict(vars(answers))
    exec(compile(source, f"<a step where {what}>", "exec"), namespace)
    return namespace["step"]


def show_wrong_step(what: str = "the blocks move after the model ran", num_cases: int = 5) -> str:
    """Run ``LLMEngine.step``'s check on a step where ``what`` (your own result stays as it is);
    print and return its message."""
    from minipaged.exercises.checking import ExerciseFailed

    try:
        ran = _check_engine_step(wrong_step(what), random.Random(0), num_cases)
        message = f"(this wrong step passed {ran} cases: the check missed it)"
    except ExerciseFailed as caught:
        message = str(caught)
    print(message)
    return message
