"""Multi-step decode: one schedule, several decode steps (lesson 15).

On a GPU the model's part of a decode step is one CUDA-graph replay of a few milliseconds.
Around it the host schedules, lays out the batch, reads the sampled tokens back and appends
them (about 2 ms for 64 sequences in ``benchmarks/RESULTS.md``), and the GPU waits, because the
next step's inputs are this step's tokens. With ``num_scheduler_steps = k`` a batch of greedy
decodes is scheduled once and runs k steps:

    plan()      before the schedule: every running sequence asks for k - 1 lookahead slots, the
                slots speculative decoding reserves (lesson 12), fewer near ``max_model_len``
    steps()     after it: k if the batch is greedy decodes only (the scheduler may have lowered
                the lookahead), else 1, the ordinary step
    run()       k steps back to back. Step j's positions, slots and context lengths are step 0's
                plus j, built on the host at once; its input tokens are step j-1's argmax, which
                never leave the device. Each step's tokens and logprobs are copied to the host
                without waiting for them, and the host appends step j's tokens (stop strings,
                EOS, max_tokens as always) while the device runs the steps after it.
    end_step()  the lookahead blocks no token filled go back to the pool

A sequence that stops at step j ran the k - 1 - j steps after it for nothing: their tokens are
dropped, so each output holds the tokens single steps would give it. (Float noise aside: the
batch keeps its rows for all k steps where single steps would drop finished ones.)

Only greedy batches go k at a time: a random draw uses the sequence's own generator on the host
(``worker/sampler.py``), and penalties and beams read the host's copy of the sequence. (Top-n
logprobs are one more ``topk`` on the device.) Any other batch, and any step with prompt tokens,
is one ordinary step.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from minipaged.core.scheduler import Scheduler
from minipaged.core.scheduler_outputs import SchedulerOutputs
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.worker.model_runner import PreparedInputs, to_device_at_once
from minipaged.worker.sampler import SequenceOutput


def can_multi_step(seq_group: SequenceGroup) -> bool:
    """Can this group decode several steps with its tokens chosen on the device?"""
    params = seq_group.sampling_params
    if (not params.greedy or params.presence_penalty or params.frequency_penalty
            or seq_group.pending_chunks):
        return False
    # plain decodes only: everything but the newest token is in the cache
    return all(seq.num_computed_tokens == seq.get_len() - 1
               for seq in seq_group.get_seqs(SequenceStatus.RUNNING))


def later_steps(start: int, block_table: list[int], num_steps: int,
                block_size: int) -> list[tuple[int, int, int]]:
    """(position, slot, context length) of each step of a decode run whose step 0 runs the
    token at ``start`` (lesson 15's exercise): one position further each step, the slot where
    that position's K and V go, and the context the token attends to, itself included."""
    return [(p, block_table[p // block_size] * block_size + p % block_size, p + 1)
            for p in range(start, start + num_steps)]


def to_host_soon(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying ``t`` to the host; returns (the host tensor, an event to wait on before
    reading it, or None when it is readable now)."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()  # (on the current stream, after the copy)
    return host, done


class MultiStep:
    """The engine's multi-step decode (``num_scheduler_steps``).

    Args:
        num_steps: k, the most decode steps one schedule runs (1: off).
        block_size: tokens per block (the slots of later steps come from the block tables).
    """

    def __init__(self, num_steps: int, block_size: int) -> None:
        self.num_steps = num_steps
        self.block_size = block_size
        self._planned: list[Sequence] = []
        self.num_runs = 0  # schedules that ran more than one decode step
        self.num_later_steps = 0  # decode steps those ran after their first

    def plan(self, running: list[SequenceGroup], max_model_len: int) -> None:
        """Ask for k - 1 lookahead slots per running sequence, if every running group can go
        k steps (a prompt still to run, or one group that samples, makes it an ordinary step)."""
        if self.num_steps == 1 or not running or not all(map(can_multi_step, running)):
            return
        for seq_group in running:
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                # positions up to max_model_len - 1 only: the model has no others
                seq.num_lookahead_slots = max(
                    0, min(self.num_steps, max_model_len - seq.get_len()) - 1)
                self._planned.append(seq)

    def steps(self, outs: SchedulerOutputs) -> int:
        """How many decode steps this schedule runs: 1 + the smallest lookahead the scheduler
        left a sequence, or 1 if the step is not greedy decodes only."""
        if (not self._planned or outs.prefill_chunks or not outs.decode_seq_groups
                or not all(map(can_multi_step, outs.decode_seq_groups))):
            return 1
        return 1 + min(seq.num_lookahead_slots for seq_group in outs.decode_seq_groups
                       for seq in seq_group.get_seqs(SequenceStatus.RUNNING))

    @torch.inference_mode()
    def run(self, num_steps: int, inputs: PreparedInputs, outs: SchedulerOutputs, worker,
            device: torch.device, output_processor, scheduler: Scheduler, stats,
            t: list[float]) -> None:
        """Run ``num_steps`` decode steps of the scheduled batch and append their tokens
        (a clock reading is appended to ``t`` once all are launched, and once all are applied).

        Args:
            num_steps: from ``steps``.
            inputs: step 0's prepared batch (decodes only).
            outs: the schedule (its decode runs, in the order of ``inputs.rows``).
            worker: runs the model (``execute_model``).
            device: where the inputs live (``LLMEngine.device``).
            output_processor, scheduler, stats: the engine's, as in an ordinary step.
        """
        runs = [r for r in outs.seq_runs if not r.is_prompt]  # one row each, as in inputs.rows
        # Steps 1 .. k-1: (position, slot, context length) of every row, step by step, in each
        # KV cache group's table (one for most models; a hybrid model's: lesson 20). Positions
        # and context lengths are the same in every group, the slots are each table's own.
        num_groups = 1 + len(runs[0].other_block_tables)
        layout = torch.tensor([[later_steps(r.start, table, num_steps, self.block_size)[1:]
                                for table in (r.block_table, *r.other_block_tables)]
                               for r in runs], dtype=torch.long)  # (rows, groups, k - 1, 3)
        layout = layout.view(len(runs), num_groups, num_steps - 1, 3).permute(3, 1, 2, 0)
        positions_t, slots_t, context_lens_t = to_device_at_once(  # slots: (groups, k-1, rows)
            [layout[0, 0].contiguous(), layout[1].contiguous(), layout[2, 0].to(torch.int32)],
            device)

        # top-n logprobs where asked (logprobs=n), as the sampler forms them
        num_top = [r.seq_group.sampling_params.logprobs or 0 for r in runs]
        pending = []  # per step: (host tensor (2 + 2n, rows): tokens, logprobs, top n, event)
        step_inputs = inputs
        for j in range(num_steps):
            if j:
                later = dict(context_lens=context_lens_t[j - 1],
                             max_context_len=inputs.meta.max_context_len + j)
                meta = replace(inputs.meta, slot_mapping=slots_t[0, j - 1], **later)
                if inputs.meta.group_metas is not None:
                    meta.group_metas = [replace(m, slot_mapping=slots_t[g, j - 1], **later)
                                        for g, m in enumerate(inputs.meta.group_metas, 1)]
                step_inputs = replace(inputs, input_ids=tokens, positions=positions_t[j - 1],
                                      meta=meta)
            logits = worker.execute_model(step_inputs)  # (rows, vocab) float32
            # The sampler's greedy choice (worker/sampler.py), on the device: the first of the
            # largest logits, and its logprob.
            best, tokens = torch.max(logits, dim=-1)  # (rows,), (rows,)
            lse = torch.logsumexp(logits, dim=-1)
            parts = [tokens.double()[None], (best - lse).double()[None]]
            top_n = min(max(num_top), logits.shape[-1])
            if top_n:
                top = torch.topk(logits, top_n, dim=-1)  # (rows, n)
                parts += [top.indices.double().T, (top.values - lse[:, None]).double().T]
            del logits  # (its memory serves the next step's logits)
            pending.append(to_host_soon(torch.cat(parts)))
            tokens = tokens.to(device)  # step j + 1's input tokens
        t.append(time.perf_counter())

        for j, (host, done) in enumerate(pending):
            if done is not None:
                done.synchronize()  # step j is done; the device goes on with the later ones
            step_tokens, step_logprobs, *tops = host.tolist()
            top_n = len(tops) // 2
            stats.count_tokens(0, len(runs), 0)
            for i, (run, token, logprob) in enumerate(zip(runs, step_tokens, step_logprobs)):
                seq = run.seq_group.find(run.seq_ids[0])
                if seq.is_finished():
                    continue  # it stopped at an earlier step: this token is dropped
                seq.num_computed_tokens = run.end + j  # its tokens before this one are cached
                token = int(token)
                lps = {token: logprob}
                for n in range(min(num_top[i], top_n)):  # (the chosen token's comes first)
                    lps.setdefault(int(tops[n][i]), tops[top_n + n][i])
                output_processor.process(
                    run.seq_group, {seq.seq_id: SequenceOutput(seq.seq_id, token, lps)},
                    scheduler)
                stats.num_sampled_tokens += 1
        self.num_runs += 1
        self.num_later_steps += num_steps - 1
        t.append(time.perf_counter())

    def end_step(self, scheduler: Scheduler) -> None:
        """Free the lookahead blocks that no token filled; no lookahead outside a step."""
        for seq in self._planned:
            if seq.num_lookahead_slots and seq.status is SequenceStatus.RUNNING:
                scheduler.rollback_slots(seq)
            seq.num_lookahead_slots = 0
        self._planned = []
