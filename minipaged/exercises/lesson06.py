"""Lesson 06 exercises: which KV blocks a warp visits, and V2's combination of partitions.

    warp_blocks(warp, start, end, block_size) -> [blocks]
        the KV blocks of the sequence (indices into its block table) that warp ``warp`` of a
        CUDA block covering the tokens [start, end) visits, in order (4 warps per CUDA block)
    combine_partitions(max_logits, exp_sums, outs) -> (head_size,) array
        V2's second kernel: from each partition's maximum logit, sum of exponentials and
        normalised output, the attention output over the whole context

The build track's component (``minipaged.exercises.workbench``), in CUDA C++:

    softmax_phase_cuda
        phase 3 of the real kernel (the softmax with its two block-wide reductions), as a string
        of C++ that replaces the lines between the ``softmax_phase`` markers of
        ``csrc/paged_attention.cu``. ``minipaged.lab.kernel_exercise`` compiles it into the V1
        kernel for one shape, runs it on random N(0, 1) inputs under ThreadSanitizer (and once
        under AddressSanitizer), and the checker compares every thread's maximum and sum and
        the output with the torch reference.

Expected answers: ``emulator.warp_blocks`` (the loop the real kernel's recorded visits follow,
tests/kernels/test_kernel_trace.py); for the partitions, softmax over the whole context times the
values, computed in float64 by NumPy, on logits up to 1000 away from 0 (past float64's exp).
"""
from __future__ import annotations

import datetime
import json
import re

import numpy as np

from minipaged.lab import emulator as emu
from minipaged.lab import kernel_exercise
from minipaged.exercises import softmax_phase_hints as hints
from minipaged.exercises import workbench
from minipaged.exercises.checking import (CheckResult, ExerciseFailed, Learner, NotDone, exercise,
                                          fail, passed, rng_for)


@exercise
def check_warp_blocks(fn, num_cases: int = 300, seed: int | None = 0) -> CheckResult:
    learner = Learner("warp_blocks", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        block_size = rng.choice([8, 16, 32])
        partition = 512 if case % 2 else None  # V2 partitions of 512 tokens, or V1
        context_len = rng.randint(1, 1600 if partition else 300)
        if partition:
            start = rng.randrange(0, context_len, partition)
            end = min(start + partition, context_len)
        else:
            start, end = 0, context_len
        warp = rng.randrange(4)
        expected = emu.warp_blocks(warp, start, end, block_size)
        got = learner(warp, start, end, block_size)
        got = list(got) if isinstance(got, (list, tuple, range)) else got
        if got != expected:
            hint = ("the warps deal the CUDA block's KV blocks like cards, 4 players; count "
                    "the blocks from the one that holds token `start`, and round up")
            if isinstance(got, list) and expected and got and got[0] != expected[0]:
                hint = ("the first block: a V2 partition starts at token `start`, so its "
                        "blocks start at the block of the sequence that holds that token")
            fail(learner.name, case, f"warp={warp}, start={start}, end={end}, "
                 f"block_size={block_size}", got, expected, hint)
    return passed(learner, num_cases)


@exercise
def check_combine_partitions(fn, num_cases: int = 100, seed: int | None = 0) -> CheckResult:
    learner = Learner("combine_partitions", fn)
    rng = np.random.default_rng(seed)
    for case in range(num_cases):
        length, head_size, size = int(rng.integers(1, 2000)), 8, 512
        logits = rng.standard_normal(length) * float(rng.choice([1.0, 30.0]))
        if case % 4 == 3:
            # NOTE: softmax ignores a shift, float64 does not: exp(750) overflows and exp(-750)
            # is 0, so an answer that weighs partitions by exp(max_logit) without one common
            # maximum subtracted gives inf / inf or 0 / 0 here.
            logits += float(rng.choice([1.0, -1.0])) * float(rng.uniform(750.0, 1000.0))
        values = rng.standard_normal((length, head_size))
        starts = range(0, length, size)
        max_logits = np.array([logits[s:s + size].max() for s in starts])
        exp_sums = np.array([np.exp(logits[s:s + size] - m).sum()
                             for s, m in zip(starts, max_logits)])
        outs = np.stack([np.exp(logits[s:s + size] - m) / e @ values[s:s + size]
                         for s, m, e in zip(starts, max_logits, exp_sums)])
        p = np.exp(logits - logits.max())
        expected = p / p.sum() @ values
        got = learner(max_logits.copy(), exp_sums.copy(), outs.copy())
        got = np.asarray(got, dtype=np.float64) if got is not None else got
        if got is None or got.shape != expected.shape or not np.allclose(got, expected,
                                                                       rtol=1e-6, atol=1e-9):
            hint = ("each partition's output is normalised by its own sum with its own "
                    "maximum: weigh it by how much of the whole softmax it holds, measured "
                    "against one common maximum")
            if got is not None and got.shape == expected.shape and not np.isfinite(got).all():
                hint = ("NaN or overflow: exponentials of raw logits overflow; subtract the "
                        "largest maximum first")
            fail(learner.name, case, f"{len(outs)} partitions, head_size={head_size}",
                 None if got is None else np.round(got[:3], 4).tolist(),
                 np.round(expected[:3], 4).tolist(), hint)
    return passed(learner, num_cases)


# -- the build track: phase 3 of the real kernel, in CUDA C++ ------------------------------------
SOFTMAX_PHASE_STUB = r"""  // Phase 3 of attend() in csrc/paged_attention.cu: the softmax. What phase 2 left you:
  //   qk_max    this thread's largest logit (-FLT_MAX if it computed none); the G lanes of a
  //             thread group hold the same value
  //   logits    [num_tokens] the scaled q.k in shared memory, written by phase 2 (other warps'
  //             writes are visible only after a barrier)
  //   red_smem  [2 * NUM_WARPS] shared scratch: one slot per warp for each reduction
  //   warp, lane, NUM_WARPS (4), NUM_THREADS (128), WARP_SIZE (32), G, FULL_MASK
  // What phase 4 needs from you, in every thread:
  //   max_logit  the largest logit of the CUDA block
  //   exp_sum    the sum of expf(logits[i] - max_logit) over the num_tokens logits
  //   logits[i]  replaced by expf(logits[i] - max_logit) / exp_sum, all written before phase 4
  //              reads any of them
  // Write the reductions yourself: __shfl_xor_sync inside a warp, red_smem between warps.
  float max_logit = -FLT_MAX;
  float exp_sum = 0.f;
  not_done();  // <- your code here
"""
NAME = "softmax_phase_cuda"
_NOT_DONE = re.compile(r"\bnot_done\s*\(\s*\)\s*;")


def _rel_err(got, expected) -> float:
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-30))


def _learner_lines(code: str, report: str) -> str:
    """The learner's lines a sanitizer report names, quoted from their code."""
    lines = code.split("\n")
    named = [n for n in kernel_exercise.report_lines(report) if 0 < n <= len(lines)]
    return "".join(f"\n    line {n}: {lines[n - 1].strip()}" for n in named[:4]) or \
        " (no line of yours in the report)"


def _failed(case: int, what: str, hint: str) -> None:
    raise ExerciseFailed(f"✗ {NAME}: case {case} fails\n  {what}\n  hint: {hint}")


def _check_case(code: str, program, case_number: int, case) -> None:
    result = kernel_exercise.run(program, case)
    if "ThreadSanitizer: data race" in result.report:
        _failed(case_number, f"ThreadSanitizer reports a data race:"
                f"{_learner_lines(code, result.report)}", hints.race_hint(code, result.report))
    if result.out is None:
        _failed(case_number, f"the kernel did not finish (exit {result.returncode}):\n"
                f"{result.report[-1500:]}", "read the report: it names the line that failed")
    lens = case.context_lens.tolist()
    for seq, n in enumerate(lens):
        for head in range(case.query.shape[1]):
            where = (f"context_lens={lens}, CUDA block (head {head}, sequence {seq}: {n} "
                     f"tokens)")
            maxes, sums = result.thread_max[seq, head], result.thread_sum[seq, head]
            logits = case.logits(seq, head)  # (n,) float64
            want_max = float(logits.max())
            want_sum = float(np.exp((logits - want_max).numpy()).sum())
            for values, name, want in ((maxes, "max_logit", want_max),
                                       (sums, "exp_sum", want_sum)):
                if not bool((values == values[0]).all()):
                    what, hint = hints.disagreement(values, name, want)
                    _failed(case_number, f"{where}: {what}", hint)
            if abs(float(maxes[0]) - want_max) > 1e-5 * max(1.0, abs(want_max)):
                _failed(case_number, f"{where}: max_logit is {float(maxes[0]):.6f}, the "
                        f"largest logit is {want_max:.6f}",
                        "the maximum over the whole CUDA block: each warp's butterfly, then "
                        "the NUM_WARPS warps' maxima combined through red_smem (after a "
                        "barrier)")
            if abs(float(sums[0]) - want_sum) > 1e-4 * want_sum:
                _failed(case_number, f"{where}: exp_sum is {float(sums[0]):.6f}, the sum of "
                        f"exp(logit - max) is {want_sum:.6f}",
                        "every one of the num_tokens logits counts once: each thread adds its "
                        "tokens (threadIdx.x, + NUM_THREADS, ...), the warp's butterfly runs "
                        "over all 32 lanes, then the warps add up through slots of their own")
    error = _rel_err(result.out, case.reference())
    if error > 1e-5:
        _failed(case_number, f"context_lens={lens}: the kernel's output differs from the torch "
                f"reference (relative error {error:.1e}) though the maximum and sum are right",
                "phase 4 reads logits[i] as probabilities: every one divided by exp_sum, in "
                "place, and all written before phase 4 starts (a barrier)")


def _check_softmax_phase(code, rng, num_cases: int) -> int:
    if not isinstance(code, str):
        _failed(0, f"got a {type(code).__name__}", "the component is C++ source, a string")
    if _NOT_DONE.search(code):
        raise NotDone(NAME)
    called = hints.helpers_called(code)
    if called:
        raise ExerciseFailed(f"✗ {NAME}: refused before building: {hints.refusal(called)}")
    try:
        program = kernel_exercise.build(code, "thread")
    except kernel_exercise.CompileError as error:
        lines = code.split("\n")
        quoted = re.sub(re.escape(kernel_exercise.LEARNER_FILE) + r":(\d+):(.*)",
                        lambda m: f"line {m.group(1)}:{m.group(2)}\n    | "
                                  f"{lines[int(m.group(1)) - 1].strip() if 0 < int(m.group(1)) <= len(lines) else ''}",
                        str(error))
        raise ExerciseFailed(f"✗ {NAME}: your code does not compile (lines numbered from 1 as "
                             f"in your string):\n{quoted}") from None
    for case_number in range(num_cases):
        short = rng.randint(2, 16)
        lens = (1, short, rng.randint(17, 64), rng.randint(65, 300))
        _check_case(code, program, case_number,
                    kernel_exercise.random_case(rng.randrange(2 ** 31), lens))
    case = kernel_exercise.random_case(rng.randrange(2 ** 31), (3, 40, 129))
    result = kernel_exercise.run(kernel_exercise.build(code, "address"), case)
    if "AddressSanitizer" in result.report:
        _failed(num_cases, f"AddressSanitizer reports a read or write outside a buffer:"
                f"{_learner_lines(code, result.report)}",
                "logits holds num_tokens values (rounded up to whole blocks), red_smem "
                "2 * NUM_WARPS: stay inside them")
    return num_cases + 1


def save_softmax_phase(code: str):
    """Keep the learner's C++ for the capstone as ``workbench.collect`` reads components: a
    ``.py`` file under ``workbench.learner_dir()`` whose header names ``SOFTMAX_PHASE``."""
    header = {"component": NAME, "lesson": "06", "object": "SOFTMAX_PHASE",
              "saved": datetime.datetime.now().isoformat(timespec="seconds")}
    folder = workbench.learner_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{NAME}.py"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"# minipaged build track: {json.dumps(header)}\nSOFTMAX_PHASE = {code!r}\n")
    tmp.replace(path)
    return path


def check_softmax_phase(code: str) -> CheckResult:
    """``check_component("softmax_phase_cuda", code)``, then the C++ is saved for the capstone
    (``save_component`` keeps the source of classes and functions, not strings)."""
    result = workbench.check_component(NAME, code, save=False)
    if result.passed:
        print(f"  saved for the capstone in {save_softmax_phase(code)}")
    return result


workbench.register(workbench.Component(
    name=NAME, lesson="06", slots=("minipaged.lab.kernel_exercise:PHASE3",),
    check=_check_softmax_phase, solution="minipaged.exercises.answers.lesson06:SOFTMAX_PHASE",
    num_cases=3))
