"""Lesson 17 exercises: reading vLLM V1 with minipaged's names, and predicting its scheduler.

    v1_names() -> dict[str, str | None]
        for each minipaged name in ``MINIPAGED_NAMES``, the V1 name that plays its part (one of
        ``V1_WORD_BANK``), or None where V1 has no counterpart
    predict_v1_steps() -> list[dict[str, int]]
        for the trace ``TRACE`` (three requests waiting at step 1, in order), a token budget of
        ``TOKEN_BUDGET``, blocks of ``BLOCK_SIZE`` tokens and a pool of ``NUM_BLOCKS`` blocks:
        V1's ``num_scheduled_tokens`` of every step, one dict per step, request name -> tokens
        (requests given no tokens left out), until every request has finished

Expected answers: ``V1_NAMES`` below (read off vLLM V1's source tree), and
``minipaged.lab.v1_policy.v1_steps`` on the trace.
"""
from __future__ import annotations

from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed
from minipaged.lab.v1_policy import TraceRequest, v1_steps

# minipaged name -> (V1 names accepted, where V1 has it / the idea, for the hint)
V1_NAMES: dict[str, tuple[tuple[str | None, ...], str]] = {
    "SequenceGroup": (("Request",), "one user's request with its tokens and status: "
                      "vllm/v1/request.py"),
    "Sequence.num_computed_tokens": (("Request.num_computed_tokens",),
                                     "the one counter V1's scheduler reads for every request"),
    "SchedulerOutputs": (("SchedulerOutput",), "what the scheduler hands the workers: "
                         "vllm/v1/core/sched/output.py"),
    "BlockSpaceManager": (("KVCacheManager",), "the object the scheduler asks for slots: "
                          "vllm/v1/core/kv_cache_manager.py"),
    "FreeListAllocator": (("BlockPool",), "the owner of every block and the free queue: "
                          "vllm/v1/core/block_pool.py"),
    "PhysicalTokenBlock": (("KVCacheBlock",), "one block's bookkeeping: "
                           "vllm/v1/core/kv_cache_utils.py"),
    "PhysicalTokenBlock.ref_count": (("KVCacheBlock.ref_cnt",),
                                     "a field of the block class, spelled short"),
    "prepare_inputs": (("GPUModelRunner._prepare_inputs",),
                       "a method of the model runner: vllm/v1/worker/gpu_model_runner.py"),
    "InputMetadata": (("FlashAttentionMetadata", "CommonAttentionMetadata"),
                      "what the attention back-end reads: query_start_loc, seq_lens, "
                      "block_table, slot_mapping"),
    "LLMEngine.step": (("EngineCore.step",), "the loop of the engine-core process: "
                       "vllm/v1/engine/core.py"),
    "blocks_to_swap_out": ((None,), "does V1's scheduler ever move blocks to the CPU when it "
                           "preempts?"),
    "blocks_to_copy": ((None,), "V1 runs n > 1 as separate child requests sharing the prompt "
                       "through prefix caching: is there a shared last block to copy?"),
}
MINIPAGED_NAMES = list(V1_NAMES)
V1_WORD_BANK = sorted({name for accepted, _ in V1_NAMES.values() for name in accepted
                       if name is not None} | {"InputBatch", "EngineCoreClient",
                                               "FreeKVCacheBlockQueue"})

TRACE = [TraceRequest("a", 10, 4), TraceRequest("b", 7, 3), TraceRequest("c", 5, 2)]
TOKEN_BUDGET, BLOCK_SIZE, NUM_BLOCKS = 8, 4, 6


@exercise
def check_v1_names(fn) -> CheckResult:
    learner = Learner("v1_names", fn)
    got = learner()
    if not isinstance(got, dict):
        fail(learner.name, 0, "v1_names()", got, "a dict", "return a dict: minipaged name -> "
             "V1 name (or None)")
    for case, name in enumerate(MINIPAGED_NAMES):
        accepted, hint = V1_NAMES[name]
        if name not in got:
            fail(learner.name, case, f"minipaged name {name!r}", "(missing)",
                 "a V1 name or None", f"every name of MINIPAGED_NAMES needs an entry; {hint}")
        if got[name] not in accepted:
            # NOTE: the expected answer is not printed: the hint points at the file or the idea.
            fail(learner.name, case, f"minipaged name {name!r}", got[name], "see the hint",
                 f"{hint} (the word bank holds it)" if accepted[0] else hint)
    return passed(learner, len(MINIPAGED_NAMES))


def _hint(step: int, got: dict, expected: dict, preempted_before: bool) -> str:
    total = sum(v for v in got.values() if isinstance(v, int))
    if total > TOKEN_BUDGET:
        return f"a step computes at most the token budget ({TOKEN_BUDGET}) in all"
    if len(got) > len(expected) and preempted_before:
        return ("in a step that preempted, V1 admits no waiting request: the preempted one "
                "is at the front of the waiting queue")
    if set(got) != set(expected):
        return ("running requests first, oldest first, then waiting ones while budget and "
                "blocks last; a request joins the running queue as soon as it gets tokens, "
                "even if only a chunk of its prompt")
    return ("each request gets what it has not computed yet (num_tokens - "
            "num_computed_tokens), capped by what is left of the budget; a preempted request "
            "has computed nothing: its prompt and the tokens it sampled are all computed again")


@exercise
def check_predict_v1_steps(fn) -> CheckResult:
    learner = Learner("predict_v1_steps", fn)
    got = learner()
    records = v1_steps(TRACE, TOKEN_BUDGET, BLOCK_SIZE, NUM_BLOCKS)
    expected = [s.num_scheduled_tokens for s in records]
    if not isinstance(got, list) or not all(isinstance(s, dict) for s in got):
        fail(learner.name, 0, "predict_v1_steps()", got, "a list of dicts",
             "one dict per step: request name -> tokens scheduled")
    for step, want in enumerate(expected):
        if step >= len(got):
            fail(learner.name, step + 1, f"step {step + 1}", "(no step)", want,
                 "the trace runs until every request has sampled max_tokens tokens")
        have = {k: v for k, v in got[step].items() if v != 0}
        if have != want:
            preempted_before = bool(records[step].preempted)
            fail(learner.name, step + 1, f"step {step + 1}", got[step], want,
                 _hint(step, have, want, preempted_before))
    if len(got) > len(expected):
        fail(learner.name, len(expected) + 1, f"step {len(expected) + 1}", got[len(expected)],
             "(no step)", "every request has finished by then")
    return passed(learner, len(expected))


__all__ = ["BLOCK_SIZE", "MINIPAGED_NAMES", "NUM_BLOCKS", "TOKEN_BUDGET", "TRACE",
           "V1_WORD_BANK", "check_predict_v1_steps", "check_v1_names"]
