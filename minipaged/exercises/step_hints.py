"""Lesson 16: the hints of ``LLMEngine.step``'s check, each keyed to the cause.

The check (``lesson16._check_engine_step``) compares the learner's engine with the package's after
every step (``capstone_steps.first_difference``); the first thing that differs picks the hint: a
sequence's tokens (too many, too few, another token), the blocks, the queues, what ``step()``
returned, or the engine's counters (by the counter that differs first: where it is counted).
"""
from __future__ import annotations

from minipaged.sampling_params import SamplingParams


STEP_HINTS = {
    "observers": "after the step, call each of self._observers once with the step's "
                 "StepSnapshot.of_step(...): the lessons draw from it",
    "observers late": "the observers see the step as it ends: every new token appended, the "
                      "finished groups freed and forgotten (free_finished_seq_groups), every "
                      "group that ended in the step (finished, or given up on) in the snapshot, "
                      "the step counted; only then is the snapshot taken",
    "block_tables": "a sequence that finishes gives its blocks back in the step it finishes "
                    "(self.scheduler.free_seq); blocks change only through the scheduler",
    "queues": "a group that finished leaves the running queue in the same step, once all its "
              "new tokens are appended (self.scheduler.free_finished_seq_groups())",
    "unfinished_requests": "the engine forgets every group that finished or was given up on "
                           "(self._forget)",
    "returned": "return one RequestOutput.from_seq_group(g) per group the step scheduled, and "
                "per group the scheduler gave up on",
}
# The engine's counters (self.stats), by the counter that differs first: where it is counted.
_STATS_HINTS = {
    "num_steps": "count each step once: self.stats.num_steps += 1, before the observers see "
                 "the snapshot",
    "num_prompt_tokens": "once the model ran, count what it computed: self.stats.count_tokens("
                         "inputs.meta.num_prompt_tokens, inputs.meta.num_generation_tokens, 0)",
    "num_sampled_tokens": "count the tokens the sampler returned: self.stats.num_sampled_tokens "
                          "+= one per sequence it sampled for",
    "num_aborted_by_engine": "the requests the scheduler gave up on are counted by "
                             "self._collect_aborted(): call it once, right after schedule()",
    "time_model > 0": "time the model: self.stats.time_model += the seconds execute_model took "
                      "(time.perf_counter() before and after)",
}
_STATS_HINTS["num_generation_tokens"] = _STATS_HINTS["num_prompt_tokens"]
STEP_HINTS["ref_counts"] = STEP_HINTS["free_gpu_blocks"] = STEP_HINTS["free_cpu_blocks"] = \
    STEP_HINTS["block_tables"]
_SCHEDULE_COUNT = ("count what the scheduler decided, once, right after schedule(): "
                   "self.stats.count_schedule(outs, self.scheduler.pool_counts())")


def observer_hint(field: str) -> str:
    """The hint when what the observers got differs (``field``: the snapshot's field, "" for
    their number): the snapshot was taken at another moment, or with other groups."""
    return STEP_HINTS["observers"] if not field else STEP_HINTS["observers late"]


def stats_hint(expected: dict) -> str:
    """The hint for the first of the engine's counters that differs (``expected``: the
    package's values of those that differ, in the order ``step_state`` lists them)."""
    first = next(iter(expected))
    return _STATS_HINTS.get(first, _SCHEDULE_COUNT)


def sequence_hint(yours, expected, params: SamplingParams | None = None) -> str:
    if yours is None:
        return "every sequence of a request the engine added must stay in its group"
    mine, theirs = len(yours["token_ids"]), len(expected["token_ids"])
    if (mine > theirs and params is not None and params.use_beam_search
            and yours["token_ids"][-1] == expected["token_ids"][-1]):
        # its own new token is there, with one more before it: the parent's new token, taken
        # along by a copy made after the parent appended
        return ("beam search: a dropped beam becomes a copy of its parent before ANY sequence "
                "of the group appends its new token (copy every dropped beam first, then "
                "append): a copy made after the parent appended takes the parent's new token "
                "along, and the beam has one token too many")
    if mine > theirs:
        return ("a sequence takes one token per step, appended after the sampler ran; the stop "
                "checks (output_processor.check_stop) look at the token just appended")
    if mine < theirs:
        return ("every sequence the sampler returned a token for appends it in this step (beam "
                "search: a dropped beam first becomes a copy of its parent)")
    if yours["token_ids"] != expected["token_ids"]:
        return ("the model must read a cache whose blocks have already moved: swaps and "
                "copy-on-write copies (self.worker.cache_swap) come before the model runs; each "
                "sequence appends the token the sampler chose for its own seq_id")
    if yours["num_computed_tokens"] != expected["num_computed_tokens"]:
        return ("once the model ran, each sequence in inputs.computed has num_computed_tokens "
                "as given there")
    return "after a token is appended, check_stop(seq, params) decides whether seq is finished"
