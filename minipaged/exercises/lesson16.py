"""Lesson 16 exercises: assemble the engine (the capstone).

``RunningGroup(request_id, blocks_held, blocks_needed)``: a running group, oldest first: the
distinct blocks its sequences hold (what preempting it by recompute frees) and the blocks its
sequences' next tokens take (new blocks and copy-on-write copies, an integer: a request with
``n > 1`` may need several).

    pick_victims(running, num_free) -> (kept, preempted)
        step 1 of ``Scheduler.schedule``: serve the groups oldest first; while a group's
        ``blocks_needed`` exceed the free blocks, preempt the NEWEST group not served yet (its
        blocks become free); if none is left, the group itself is preempted. A kept group takes
        its blocks. ``preempted`` in the order they were preempted.
    step_slot_mapping(seqs, block_size, slot_of) -> list[int]
        the slot of every token of a step's flat batch (lesson 08's ``SeqView``s, in any
        order): every token of the prompt runs first, then one token per decode, each from
        ``slot_of(block_table, position, block_size)`` (lesson 02's function, passed in)
    check_engine(plugins)
        the assembly: ``AssembledEngine`` (``lab/assembled_engine.py``) with your plug-ins runs
        next to ``LLM()`` and must give the same tokens and block tables at every step

Expected answers: the real ``Scheduler`` (preemption by recompute) on random traffic, the
package's ``prepare_inputs`` on random mixed steps, and ``LLMEngine`` itself.
"""
from __future__ import annotations

import copy
import itertools
from typing import Callable, NamedTuple

import torch

from minipaged.exercises import solutions
from minipaged.exercises.checking import (CheckResult, ExerciseFailed, Learner, NotDone,
                                          exercise, fail, passed, rng_for)
from minipaged.lab.assembled_engine import (PLUGINS, AssembledEngine, PluginError, RunningGroup,
                                            SeqView)
from minipaged.lab.batch_inputs import prepare_inputs_for_groups
from minipaged.lab.dry_run import DryRun
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import SequenceStatus

__all__ = ["RunningGroup", "SeqView", "check_pick_victims", "check_step_slot_mapping",
           "check_engine", "package_plugins", "assemble", "Request", "default_workload"]


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


# -- exercise 1: who is preempted ----------------------------------------------------------------
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
                held = len({id(b) for s in seqs for b in bm.block_tables[s.seq_id]})
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


# -- exercise 2: the slot mapping of a mixed step ------------------------------------------------
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


# -- the assembly --------------------------------------------------------------------------------
def package_plugins() -> dict[str, Callable]:
    """The answers of every plug-in: ``solutions.py``'s functions."""
    return {name: getattr(solutions, name) for name in PLUGINS}


def assemble(**learner_fns: Callable) -> dict[str, Callable]:
    """Plug-ins from your functions (by name); an unknown name is a ``ValueError``. A function
    that is still ``not_done()`` is replaced by its answer from ``solutions.py`` when first
    called; the check says which."""
    unknown = sorted(set(learner_fns) - set(PLUGINS))
    if unknown:
        raise ValueError(f"assemble: unknown plug-ins {unknown}; the plug-ins are {PLUGINS}")
    answers = package_plugins()
    return {name: _FallBack(name, learner_fns[name], answers[name])
            if name in learner_fns and learner_fns[name] is not answers[name] else answers[name]
            for name in PLUGINS}


class _FallBack:
    """The learner's function; its answer instead once it says ``not_done()``."""

    def __init__(self, name: str, fn: Callable, answer: Callable) -> None:
        self.name, self.fn, self.answer, self.not_done = name, fn, answer, False

    def __call__(self, *args):
        if not self.not_done:
            try:
                return self.fn(*args)
            except NotDone:
                self.not_done = True
        return self.answer(*args)


class Request(NamedTuple):
    prompt_token_ids: list[int]
    params: SamplingParams
    arrive_at_step: int = 0


def default_workload() -> list[Request]:
    """Five requests over a pool too small for them: greedy, parallel sampling (n = 2 and 3,
    greedy, so the sequences stay alike), and top-p sampling with seeds; one arrives later."""
    greedy = lambda n, m: SamplingParams(n=n, temperature=0, max_tokens=m, ignore_eos=True)
    top_p = lambda m, s: SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m, seed=s,
                                        ignore_eos=True)
    return [Request(list(range(10, 19)), greedy(1, 9)),
            Request(list(range(40, 46)), greedy(2, 8)),
            Request(list(range(60, 71)), top_p(8, 1)),
            Request(list(range(80, 85)), greedy(3, 6)),
            Request(list(range(90, 97)), top_p(7, 2), arrive_at_step=3)]


def tiny_llm(block_size: int = 4, num_gpu_blocks: int = 14):
    """``LLM()`` over a tiny random LLaMA (seeded weights), with the settings the assembled
    engine supports: preemption by recompute, no prefix caching, no chunked prefill."""
    from transformers import LlamaConfig

    from minipaged.entrypoints.llm import LLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LLM(None, hf_config=config, load_format="dummy", block_size=block_size,
                   num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0,
                   max_model_len=min(64, num_gpu_blocks * block_size),
                   preemption_mode="recompute", watermark=0.0, enable_prefix_caching=False,
                   enable_chunked_prefill=False, device="cpu", dtype="float32")


def engine_like(llm, plugins: dict[str, Callable]) -> AssembledEngine:
    """An ``AssembledEngine`` with ``llm``'s model, pool and limits."""
    e = llm.llm_engine
    return AssembledEngine(e.worker.model, plugins, e.block_size,
                           e.block_manager.num_total_gpu_blocks,
                           (e.model_shape.num_layers, e.model_shape.num_kv_heads,
                            e.model_shape.head_size), e.max_model_len,
                           e.scheduler_config.max_num_seqs,
                           e.scheduler_config.max_num_batched_tokens,
                           e.block_manager.watermark_blocks, e.eos_token_ids, e.seed)


class _Witness:
    """Runs each plug-in next to its answer on the same inputs and keeps the first difference,
    so that a failed check can say which plug-in went wrong first."""

    def __init__(self, plugins: dict[str, Callable], answers: dict[str, Callable]) -> None:
        self.answers, self.first = answers, None
        self.step = 0
        self.plugins = {name: self._wrap(name, fn) for name, fn in plugins.items()}

    def _wrap(self, name: str, fn: Callable) -> Callable:
        answer = self.answers[name]
        if fn is answer:
            return fn

        def call(*args):
            if name == "grow_block_table":
                table, num_tokens, block_size, allocate = args
                mine = list(table)
                answer(mine, num_tokens, block_size, lambda: -1)
                before = list(table)
                fn(*args)
                got, expected = len(table) - len(before), len(mine) - len(before)
                self._note(name, f"block_table={before}, num_tokens={num_tokens}, "
                           f"block_size={block_size}", f"{got} new block(s)",
                           f"{expected} new block(s)", got == expected)
                return None
            if name == "fork":
                table, refs = args
                refs_copy = list(refs)
                expected = (list(answer(list(table), refs_copy)), refs_copy)
                before = list(refs)
                result = fn(*args)
                got = (list(result), list(refs))
                self._note(name, f"parent_table={table}, ref_counts={before}", got, expected,
                           got == expected)
                return result
            expected = answer(*copy.deepcopy(args))
            result = fn(*args)
            if isinstance(expected, torch.Tensor):
                same = isinstance(result, torch.Tensor) and torch.equal(result, expected)
                shown = "the logits of the nucleus, -inf elsewhere"
                self._note(name, f"logits of shape {tuple(args[0].shape)}, top_p={args[1]}",
                           "a different tensor", shown, same)
            else:
                same = _plain(result) == _plain(expected)
                inputs = ", ".join(repr(a) if not callable(a) else "slot_of" for a in args)
                self._note(name, inputs, _plain(result), _plain(expected), same)
            return result

        return call

    def _note(self, name, inputs, got, expected, same) -> None:
        if not same and self.first is None:
            self.first = (f"the first plug-in that disagreed with its answer: {name}, in step "
                          f"{self.step}\n  inputs:   {inputs}\n  yours:    {got!r}\n"
                          f"  expected: {expected!r}")


def _plain(value):
    """Tuples, lists and tensors as nested lists, for comparing answers."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _tables_of_llm(snapshot) -> dict[int, list[int]]:
    return {s["seq_id"]: s["block_table"] for s in snapshot.block_manager["sequences"]}


def check_engine(plugins: dict[str, Callable] | None = None, workload: list[Request] | None = None,
                 on_step: Callable | None = None, num_gpu_blocks: int = 14,
                 block_size: int = 4, max_steps: int = 200) -> CheckResult:
    """Your engine next to ``LLM()``: the same tokens and block tables after every step.

    Args:
        plugins: from ``assemble(...)`` (default: every answer from ``solutions.py``).
        workload: the requests (default ``default_workload()``).
        on_step: called as ``on_step(step, yours, llm)`` with both engines' ``StepSnapshot``
            after every step (the lesson draws them).
        num_gpu_blocks, block_size: the pool both engines get.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is as fast, and steady on a busy CPU
    try:
        return _check_engine(plugins, workload, on_step, num_gpu_blocks, block_size, max_steps)
    finally:
        torch.set_num_threads(threads)


@exercise
def _check_engine(plugins, workload, on_step, num_gpu_blocks, block_size, max_steps):
    answers = package_plugins()
    plugins = {**answers, **(plugins or {})}  # a plug-in not given: its answer
    witness = _Witness(plugins, answers)
    llm = tiny_llm(block_size, num_gpu_blocks)
    ref = llm.llm_engine
    mine = engine_like(llm, witness.plugins)
    ref_snaps, my_snaps = [], []
    ref.add_observer(ref_snaps.append)
    mine.observers.append(my_snaps.append)
    workload = default_workload() if workload is None else workload
    ref_groups, my_groups = {}, {}
    num_preempted = num_copies = 0

    def wrong(step, text, yours=None, llms=None):
        culprit = witness.first or ("every plug-in agreed with its answer: the difference is "
                                    "in the assembled engine's own code")
        both = (f"\n  yours:    {yours!r}\n  LLM():    {llms!r}" if yours or llms else "")
        raise ExerciseFailed(f"✗ engine: step {step}: {text}{both}\n  {culprit}")

    for step in range(1, max_steps + 1):
        for i, req in enumerate(workload):
            if req.arrive_at_step == step - 1:
                rid = str(i)
                try:
                    ref.add_request(rid, None, req.params, arrival_time=float(i),
                                    prompt_token_ids=req.prompt_token_ids)
                except ValueError as exc:  # the workload, not the learner's code
                    raise ValueError(f"workload: request {i}: {exc}") from None
                ref_groups[rid] = ref.scheduler.waiting[-1]
                my_groups[rid] = mine.add_request(rid, req.prompt_token_ids, req.params,
                                                  float(i))
        pending = any(r.arrive_at_step >= step for r in workload)
        if not ref.has_unfinished_requests() and not pending:
            break
        ref.step()
        witness.step = step
        try:
            mine.step()
        except PluginError as exc:
            wrong(step, f"your engine stopped in plug-in {exc.plugin}: it {exc.detail}")
        except Exception as exc:  # the engine cannot go on with what a plug-in returned
            wrong(step, f"your engine stopped: {type(exc).__name__}: {exc}")
        ref_snap, my_snap = ref_snaps[-1], my_snaps[-1]
        if on_step is not None:
            on_step(step, my_snap, ref_snap)
        num_preempted += len(ref_snap.preempted)
        num_copies += sum(len(d) for d in ref_snap.blocks_to_copy.values())
        theirs, yours = _tables_of_llm(ref_snap), _tables_of_llm(my_snap)
        for seq_id in sorted(set(theirs) | set(yours)):
            if theirs.get(seq_id) != yours.get(seq_id):
                none = (" (None: it holds no blocks)"
                        if None in (theirs.get(seq_id), yours.get(seq_id)) else "")
                wrong(step, f"the block table of sequence {seq_id} differs{none}; plug-ins "
                      f"that changed it in this step: "
                      f"{', '.join(mine.touched.get(seq_id, ['none']))}",
                      yours.get(seq_id), theirs.get(seq_id))
        for rid, group in ref_groups.items():
            for theirs_seq, my_seq in zip(group.get_seqs(), my_groups[rid].get_seqs()):
                if theirs_seq.get_token_ids() != my_seq.get_token_ids():
                    wrong(step, f"the tokens of sequence {my_seq.seq_id} (request {rid}) "
                          f"differ", my_seq.get_token_ids(), theirs_seq.get_token_ids())
    else:
        wrong(max_steps, f"requests still unfinished after {max_steps} steps")
    yours = sorted(n for n, fn in plugins.items() if isinstance(fn, _FallBack) and not fn.not_done)
    return CheckResult(
        f"✓ engine: the same tokens and block tables as LLM() at all {step - 1} steps "
        f"({num_preempted} preemptions, {num_copies} copy-on-write copies); "
        + (f"your plug-ins: {', '.join(yours)}" if yours else "none of your functions yet")
        + ("; the others are the answers from solutions.py" if len(yours) < len(PLUGINS) else ""),
        "passed")
