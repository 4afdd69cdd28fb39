"""Lesson 17: vLLM V1's unified scheduling policy as a few lines of plain Python, next to ours.

V1's scheduler (``vllm/v1/core/sched/scheduler.py``) has no prefill phase and no decode phase.
Every request carries one number, ``num_computed_tokens``: the tokens whose K/V are already in
the cache. A step gives each request ``num_tokens - num_computed_tokens`` new tokens (its whole
prompt, a chunk of it, or the one token it sampled last), capped by what is left of the step's
token budget, running requests first, then waiting ones. Blocks are taken as the computed tokens
grow (``ceil((num_computed_tokens + new) / block_size)``), not for a whole prompt up front. When
the free blocks run out, the newest running request is preempted by recompute: its blocks are
freed, its ``num_computed_tokens`` goes back to 0, and it returns to the front of the waiting
queue; no waiting request is admitted in a step that preempted.

``v1_steps`` models that policy on a small trace (no model, no prefix caching, no speculation),
and ``minipaged_steps`` runs minipaged's own ``Scheduler`` on the same trace, so a lesson can show
the two side by side. Both return one ``StepRecord`` per step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from minipaged.validation import as_int


@dataclass(frozen=True)
class TraceRequest:
    """A request of the trace: ``prompt_len`` prompt tokens, then ``max_tokens`` sampled ones."""

    name: str
    prompt_len: int
    max_tokens: int


@dataclass
class StepRecord:
    """What one step scheduled: tokens per request, blocks held after it, who was preempted and
    who finished."""

    num_scheduled_tokens: dict[str, int]
    blocks_held: dict[str, int]
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


@dataclass
class _V1Request:
    spec: TraceRequest
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_blocks: int = 0

    @property
    def num_tokens(self) -> int:  # the prompt and every token sampled so far
        return self.spec.prompt_len + self.num_output_tokens


def _check_int(name: str, value, minimum: int) -> None:
    if as_int(value) is None or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_trace(requests: list[TraceRequest], token_budget: int, block_size: int,
                 num_blocks: int) -> None:
    _check_int("token_budget", token_budget, minimum=1)
    _check_int("block_size", block_size, minimum=1)
    _check_int("num_blocks", num_blocks, minimum=1)
    names = [r.name for r in requests]
    if len(set(names)) != len(names):
        raise ValueError(f"requests: names must be distinct, got {names}")
    for r in requests:
        _check_int(f"{r.name}.prompt_len", r.prompt_len, minimum=1)
        _check_int(f"{r.name}.max_tokens", r.max_tokens, minimum=1)
        need = math.ceil((r.prompt_len + r.max_tokens) / block_size)
        if need > num_blocks:
            raise ValueError(f"num_blocks: request {r.name} needs {need} blocks of "
                             f"{block_size} tokens, the pool has {num_blocks}")


def v1_steps(requests: list[TraceRequest], token_budget: int, block_size: int,
             num_blocks: int, max_steps: int = 200) -> list[StepRecord]:
    """V1's policy on ``requests`` (all waiting at step 1, in this order) until all finish.

    Args:
        requests: the trace, oldest first.
        token_budget: tokens one step may compute (V1's ``max_num_batched_tokens``).
        block_size: tokens per KV block.
        num_blocks: blocks in the pool.
        max_steps: a guard; the trace must finish within it.
    """
    _check_trace(requests, token_budget, block_size, num_blocks)
    waiting = [_V1Request(r) for r in requests]
    running: list[_V1Request] = []
    free = num_blocks
    steps: list[StepRecord] = []
    while waiting or running:
        if len(steps) == max_steps:
            raise RuntimeError(f"the trace did not finish in {max_steps} steps")
        budget, scheduled, preempted = token_budget, {}, []

        def allocate(req: _V1Request, new: int) -> bool:
            nonlocal free
            extra = math.ceil((req.num_computed_tokens + new) / block_size) - req.num_blocks
            if extra > free:
                return False
            free -= max(extra, 0)
            req.num_blocks += max(extra, 0)
            return True

        # 1. Running requests, oldest first: each asks for what it has not computed yet.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not allocate(req, new):
                # NOTE: V1 preempts the newest running request (by recompute only: no swap).
                victim = running.pop()
                free += victim.num_blocks
                victim.num_blocks, victim.num_computed_tokens = 0, 0
                waiting.insert(0, victim)
                preempted.append(victim.spec.name)
                if victim is req:
                    break
            else:
                scheduled[req.spec.name] = new
                budget -= new
                i += 1
        # 2. Waiting requests, only if nothing was preempted; a prompt may be cut to a chunk.
        while waiting and budget > 0 and not preempted:
            req = waiting[0]
            new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not allocate(req, new):
                break
            running.append(waiting.pop(0))
            scheduled[req.spec.name] = new
            budget -= new
        # 3. After the model ran: a request whose every token is computed samples one more.
        finished = []
        for req in list(running):
            if req.spec.name not in scheduled:
                continue
            req.num_computed_tokens += scheduled[req.spec.name]
            if req.num_computed_tokens == req.num_tokens:
                req.num_output_tokens += 1
                if req.num_output_tokens == req.spec.max_tokens:
                    running.remove(req)
                    free += req.num_blocks
                    req.num_blocks = 0
                    finished.append(req.spec.name)
        held = {r.spec.name: r.num_blocks for r in running if r.num_blocks}
        steps.append(StepRecord(scheduled, held, preempted, finished))
    return steps


def minipaged_steps(requests: list[TraceRequest], token_budget: int, block_size: int,
                    num_blocks: int, max_steps: int = 200) -> list[StepRecord]:
    """minipaged's own ``Scheduler`` (through lesson 02's ``DryRun``) on the same trace.

    Args:
        requests, token_budget, block_size, num_blocks, max_steps: as for ``v1_steps``.
    """
    from minipaged.lab.dry_run import DryRun
    from minipaged.sequence import SequenceStatus

    _check_trace(requests, token_budget, block_size, num_blocks)
    run = DryRun(block_size, num_blocks, preemption_mode="recompute")
    run.scheduler.config.max_num_batched_tokens = token_budget
    spec = {r.name: r for r in requests}
    for r in requests:
        run.add_request([1] * r.prompt_len, request_id=r.name)
    steps: list[StepRecord] = []
    while run.scheduler.has_unfinished_seqs():
        if len(steps) == max_steps:
            raise RuntimeError(f"the trace did not finish in {max_steps} steps")
        outs = run.step()
        scheduled: dict[str, int] = {}
        for chunk in outs.prefill_chunks:
            name = chunk.seq_group.request_id
            scheduled[name] = scheduled.get(name, 0) + chunk.num_tokens
        for group in outs.decode_seq_groups:
            scheduled[group.request_id] = scheduled.get(group.request_id, 0) + 1
        finished = []
        for name, group in run.groups.items():
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                if seq.get_output_len() == spec[name].max_tokens:
                    run.finish(seq)
                    finished.append(name)
        held = {}
        for name, group in run.groups.items():
            blocks = sum(len(run.block_manager.get_blocks(s.seq_id))
                         for s in group.get_seqs() if not s.is_finished())
            if blocks:
                held[name] = blocks
        preempted = [request_id for request_id, _ in outs.preempted]
        steps.append(StepRecord(scheduled, held, preempted, finished))
    return steps


def side_by_side(v1: list[StepRecord], ours: list[StepRecord], names: list[str]) -> str:
    """A Markdown table: per step, each request's tokens (and blocks held) in V1 and here.

    Args:
        v1, ours: the records of ``v1_steps`` and ``minipaged_steps``.
        names: the request names, in column order.
    """
    def cells(record: StepRecord | None) -> list[str]:
        if record is None:
            return ["" for _ in names]
        out = []
        for name in names:
            tokens = record.num_scheduled_tokens.get(name)
            text = "" if tokens is None else f"{tokens}"
            text += f" ({record.blocks_held[name]} bl)" if name in record.blocks_held else ""
            text += " preempted" if name in record.preempted else ""
            text += " done" if name in record.finished else ""
            out.append(text.strip() or "·")
        return out

    head = ["step"] + [f"V1 {n}" for n in names] + [f"here {n}" for n in names]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i in range(max(len(v1), len(ours))):
        row = [str(i + 1)] + cells(v1[i] if i < len(v1) else None) \
            + cells(ours[i] if i < len(ours) else None)
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def v1_attention_metadata(steps: list[StepRecord]) -> list[dict]:
    """Per step, what V1's attention back-end is handed for that step's flat batch.

    ``query_start_loc`` is where each request's new tokens start in the batch (a running sum
    of ``num_scheduled_tokens``, one more entry than requests); ``seq_lens`` is how many tokens
    each request attends to once this step's are written (``num_computed_tokens`` before the
    step plus those scheduled). A decode and a prompt chunk differ only in their numbers.

    Args:
        steps: the records of ``v1_steps``.
    """
    computed: dict[str, int] = {}
    out = []
    for record in steps:
        for name in record.preempted:
            computed[name] = 0  # recompute: its cache is gone
        names = list(record.num_scheduled_tokens)
        starts = [0]
        for name in names:
            starts.append(starts[-1] + record.num_scheduled_tokens[name])
        lens = [computed.get(name, 0) + record.num_scheduled_tokens[name] for name in names]
        for name, length in zip(names, lens):
            computed[name] = length
        out.append({"requests": names, "query_start_loc": starts, "seq_lens": lens})
    return out
