"""Lesson 20's build-track component: which entries of a sliding group's block table go back to
the pool before a step (``core/sliding_window.blocks_out_of_window``, which every sliding
manager calls, the sliding groups of ``core/hybrid_block_manager.py`` included).

The check runs random cases next to the package's function (lengths, windows and block sizes,
windows that are not a multiple of the block, longer than the sequence, blocks of one token,
tables with dropped entries and with the newest token's block not yet taken) and names the cause
of the first wrong entry; then it plugs the function into the engine on a tiny Gemma 3 with
KV cache groups and compares the tokens and every group's block tables, step by step, with the
package's run.
"""
from __future__ import annotations

import contextlib
import random

import torch

from minipaged.core import sliding_window
from minipaged.core.sliding_window import DROPPED_NUMBER, blocks_out_of_window
from minipaged.exercises import workbench
from minipaged.exercises.checking import ExerciseFailed, fail

NAME = "blocks_out_of_window"
WINDOW, BLOCK_SIZE = 6, 4  # the engine's run: a window of a block and a half
# (num_tokens, window, block_size, table length): the cases every check starts with
_EDGES = ((13, 5, 4, 3), (13, 4, 4, 3), (9, 1, 4, 2), (14, 4, 4, 4), (9, 2, 4, 3),
          (30, 64, 4, 8), (10, 3, 1, 9), (10, 3, 1, 10), (17, 16, 4, 4), (21, 7, 3, 7))


# -- the random cases ------------------------------------------------------------------------------
def _table(rng: random.Random, num_tokens: int, window: int, block_size: int, length: int):
    """``length`` distinct block numbers, the first ones dropped as earlier steps left them."""
    numbers = rng.sample(range(4 * length + 8), length)
    earlier = max(0, rng.randint(num_tokens - block_size * 3, num_tokens) - window) // block_size
    for i in range(rng.randint(0, max(0, min(earlier, length - 1)))):
        numbers[i] = DROPPED_NUMBER
    return numbers


def _case(rng: random.Random, case: int):
    """(num_tokens, window, block_size, table) of case ``case``: the edges, then random ones."""
    if case < len(_EDGES):
        num_tokens, window, block_size, length = _EDGES[case]
        return num_tokens, window, block_size, _table(rng, num_tokens, window, block_size, length)
    block_size = rng.choice([1, 2, 3, 4, 8, 16])
    window = rng.choice([1, block_size, 2 * block_size, rng.randint(1, 40)])
    window += rng.choice([0, 0, 1, -1]) if window > 1 else 0
    num_tokens = rng.randint(1, 4 * window + 3 * block_size)
    # the table covers the tokens before the newest (its block may not be taken yet), or more
    # (a lookahead's reserved slots)
    length = max(1, -(-(num_tokens - rng.choice([1, 1, 0, -block_size])) // block_size))
    return num_tokens, window, block_size, _table(rng, num_tokens, window, block_size, length)


def _positions(i: int, block_size: int) -> str:
    return f"positions {i * block_size} to {(i + 1) * block_size - 1}"


def _cause(got: list, want: list[int], num_tokens: int, window: int, block_size: int,
           table: list[int]) -> str:
    """What the first wrong entry of ``got`` says went wrong."""
    first = num_tokens - window  # the newest token's window starts here
    reads = (f"the newest token (position {num_tokens - 1}) reads positions {max(0, first)} to "
             f"{num_tokens - 1}")
    if len(set(got)) < len(got):
        return "an index appears twice: each entry goes back once (a block freed twice)"
    if got != sorted(got) and sorted(got) == want:
        return "the right entries, but return them in increasing order"
    if got == [table[i] for i in want]:
        return "those are the blocks' numbers: return their indices in the table"
    if any(not 0 <= i < len(table) for i in got):
        return f"an index outside the table (it has {len(table)} entries, 0 to {len(table) - 1})"
    extra = sorted(set(got) - set(want))
    missing = sorted(set(want) - set(got))
    if extra and (not missing or extra[0] < missing[0]):
        i = extra[0]
        if table[i] == DROPPED_NUMBER:
            return (f"entry {i} is already dropped ({DROPPED_NUMBER}): its block went back at an "
                    f"earlier step; giving it back again frees it twice")
        if i == len(table) - 1:
            return (f"entry {i} is the table's last: the newest block the sequence holds stays, "
                    f"whatever the window (the step writes next to it or copies it)")
        last = (i + 1) * block_size - 1
        if last == first:
            return (f"entry {i} holds {_positions(i, block_size)}: its last, {last}, is the first "
                    f"position of the window ({reads}), so it is still read")
        if last > first:
            return (f"entry {i} holds {_positions(i, block_size)}: {first} to {last} are still in "
                    f"the window ({reads}); a block goes back only when every position in it "
                    f"is before the window")
    i = missing[0]
    return (f"entry {i} holds {_positions(i, block_size)}, all before the window ({reads}): no "
            f"later token reads it, so it can go back")


def _check_cases(candidate, rng: random.Random, num_cases: int) -> None:
    for case in range(num_cases):
        num_tokens, window, block_size, table = _case(rng, case)
        inputs = (f"num_tokens={num_tokens}, window={window}, block_size={block_size}, "
                  f"block_table={table}")
        want = blocks_out_of_window(num_tokens, window, block_size, list(table))
        out = candidate(num_tokens, window, block_size, list(table))
        try:
            got = list(out)
        except TypeError:
            fail(NAME, case, inputs, out, want, "return a list of indices into the table")
        if not all(isinstance(i, int) for i in got):
            fail(NAME, case, inputs, got, want, "return the entries' indices, as ints")
        if got != want:
            fail(NAME, case, inputs, got, want,
                 _cause(got, want, num_tokens, window, block_size, table))


# -- inside the engine -----------------------------------------------------------------------------
def _engine_settings() -> dict:
    from minipaged.lab.tiny_families import tiny_config

    return dict(model=None, hf_config=tiny_config("gemma3", sliding_window=WINDOW),
                load_format="dummy", block_size=BLOCK_SIZE, num_gpu_blocks=64,
                max_model_len=64, dtype="float32", enable_prefix_caching=False, seed=0)


def engine_run(fn=None) -> tuple[dict, list]:
    """The tiny Gemma 3's run with ``fn`` as ``blocks_out_of_window`` (None: the package's):
    (each request's tokens, after each step every running sequence's table in every group)."""
    from minipaged.entrypoints.llm import LLM
    from minipaged.sampling_params import SamplingParams

    plugged = (workbench.plugged_in(objects={NAME: fn}, quiet=True) if fn is not None
               else contextlib.nullcontext())
    with plugged:
        torch.manual_seed(0)  # the dummy weights: the same in every run
        engine = LLM(**_engine_settings()).llm_engine
        manager = engine.scheduler.block_manager
        requests = ((list(range(10, 23)), SamplingParams(temperature=0, max_tokens=14,
                                                         ignore_eos=True)),
                    (list(range(40, 45)), SamplingParams(n=2, temperature=0.8, seed=3,
                                                         max_tokens=16, ignore_eos=True)))
        for number, (prompt, params) in enumerate(requests):
            engine.add_request(str(number), None, params, prompt_token_ids=prompt)
        tokens, steps = {}, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = [c.token_ids for c in out.outputs]
            steps.append({seq_id: ([b.block_number for b in table],
                                   *[[b.block_number for b in g.block_tables[seq_id]]
                                     for g in manager.groups])
                          for seq_id, table in manager.block_tables.items()})
    return tokens, steps


_package_run: list = []  # (tokens, steps) of the package's run, made once


def check_in_the_engine(candidate) -> str:
    """Compare the engine's run with ``candidate`` plugged in with the package's run; fail
    at the first step whose tables differ. Returns what was compared, in words."""
    if not _package_run:
        _package_run.append(engine_run())
    want_tokens, want_steps = _package_run[0]
    inputs = (f"the engine on a tiny Gemma 3 (KV cache groups, window {WINDOW}, blocks of "
              f"{BLOCK_SIZE}), a 13-token prompt and a 5-token one sampled twice")
    try:
        tokens, steps = engine_run(candidate)
    except ExerciseFailed:
        raise
    except Exception as error:  # the learner's function raised inside the engine
        fail(NAME, -1, inputs, f"{type(error).__name__}: {error}", "a run to the end",
             "the random cases passed but the engine's run raised: does your function keep "
             "state between calls, or change the table it is given?")
    for step, (got, want) in enumerate(zip(steps, want_steps), start=1):
        if got != want:
            seq_id = next(s for s in want if got.get(s) != want[s])
            fail(NAME, step, inputs + f", after step {step}, sequence {seq_id}'s tables",
                 got.get(seq_id), want[seq_id],
                 "the random cases passed but a group's table differs in the engine: does "
                 "your function keep state between calls, or change the table it is given?")
    if tokens != want_tokens or len(steps) != len(want_steps):
        fail(NAME, len(steps), inputs, tokens, want_tokens,
             "the tables agreed but the tokens differ: a block went back while still read")
    return (f"in the engine (a tiny Gemma 3 with KV cache groups, 3 sequences), the tokens "
            f"and every group's block tables after each of {len(steps)} steps equal the "
            f"package's")


def in_the_engine() -> str:
    """The saved copy of the learner's function (once it passed) plugged into the engine on
    the tiny Gemma 3, against the package's run; prints and returns one line."""
    if workbench.passed(NAME) is None:
        said = (f"(your {NAME} has not passed its check yet, so there is no saved copy to plug "
                f"in; once it passes, run this cell again)")
    else:
        found, missing = workbench.collect([NAME])
        try:
            if missing:
                raise ExerciseFailed(f"no saved copy to plug in: {missing[0]}")
            said = f"✓ your saved {NAME}: {check_in_the_engine(found[NAME])}"
        except ExerciseFailed as wrong:
            said = f"✗ your saved {NAME} in the engine: {wrong}"
    print(said)
    return said


def _check_blocks_out_of_window(candidate, rng: random.Random, num_cases: int) -> int:
    _check_cases(candidate, rng, num_cases)
    check_in_the_engine(candidate)
    return num_cases


workbench.register(workbench.Component(
    name=NAME, lesson="20", slots=(f"{sliding_window.__name__}:{NAME}",),
    check=_check_blocks_out_of_window,
    solution="minipaged.exercises.answers.lesson20:blocks_out_of_window",
    preamble="from minipaged.exercises.checking import not_done", num_cases=300))

__all__ = ["NAME", "check_in_the_engine", "engine_run", "in_the_engine"]
