"""Speculative decoding inside the engine's step (lesson 12).

    before schedule:  plan()     -- how many lookahead slots each decoding sequence asks for
                                    (n-gram: as many as it found; draft model: k)
    after schedule:   propose()  -- the drafts, in the slots the scheduler reserved
    the target runs:                [newest token, d1..dk] as one chunk, k + 1 rows of logits
    after the model:  apply()    -- verify, append the emitted tokens one at a time through the
                                    output processor (stops, EOS, max_tokens as always), roll back

The number of proposals is capped so that a sequence never overshoots ``max_tokens`` or
``max_model_len``: at most ``remaining - 1`` drafts, since a verification emits one more.

NOTE: a verification of k + 1 tokens costs more than a decode of one (on a CPU several times
more), so guesses that are mostly rejected make generation slower. Each sequence keeps a
moving average of its acceptance rate; when it falls below ``MIN_ACCEPTANCE`` the sequence
decodes plainly for a while (``BACKOFF_STEPS``, doubling each time it happens again, up to
``MAX_BACKOFF_STEPS``) and then guesses again. Outputs never depend on it: only speed does.
"""
from __future__ import annotations

import torch

from minipaged.speculative_config import SpeculativeConfig
from minipaged.core.scheduler import Scheduler
from minipaged.core.scheduler_outputs import SchedulerOutputs
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.spec_decode.proposers import DraftModelProposer, NgramProposer
from minipaged.spec_decode.verifier import verify
from minipaged.worker.model_runner import SpecRow

MIN_ACCEPTANCE = 0.3  # below this moving average of accepted / proposed, stop guessing a while
BACKOFF_STEPS = 8  # plain decode steps before guessing again (doubling each time)
MAX_BACKOFF_STEPS = 128


class Speculator:
    """Proposes, and applies verified tokens, for the engine.

    Args:
        config: the checked ``speculative_config``.
        vocab_size, block_size, num_gpu_blocks, dtype, device: the target's (a draft model
            gets a KV cache of the same blocks).
    """

    def __init__(self, config: SpeculativeConfig, vocab_size: int, block_size: int,
                 num_gpu_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        self.k = config.num_speculative_tokens
        self.block_size = block_size
        self.ngram = (NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
                      if config.method == "ngram" else None)
        self.draft = (DraftModelProposer(config.model, vocab_size, block_size, num_gpu_blocks,
                                         dtype, device) if config.method == "draft" else None)
        self._ngram_drafts: dict[int, list[int]] = {}
        self._planned: list[Sequence] = []
        self._draft_probs: dict[int, torch.Tensor | None] = {}
        self.last_step: dict[int, dict] = {}  # what the latest step proposed and kept, by seq id
        self.step = 0
        # seq id -> (moving average of its acceptance rate, next backoff, step it may guess again)
        self._acceptance: dict[int, tuple[float, int, int]] = {}
        self._fresh = (1.0, BACKOFF_STEPS, 0)  # a sequence that has not been verified yet

    def plan(self, running: list[SequenceGroup], max_model_len: int) -> None:
        """Set ``num_lookahead_slots`` of every decoding sequence (the scheduler may lower it)."""
        self._ngram_drafts = {}
        self.last_step = {}
        self.step += 1
        for seq_group in running:
            params = seq_group.sampling_params
            if seq_group.pending_chunks:
                continue
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                if seq.num_computed_tokens != seq.get_len() - 1:
                    continue  # not a plain decode (a prefill run)
                if self.step < self._acceptance.get(seq.seq_id, self._fresh)[2]:
                    continue  # backing off: its recent guesses were mostly rejected
                k = min(self.k, params.max_tokens - seq.get_output_len() - 1,
                        max_model_len - seq.get_len() - 1)
                if k <= 0:
                    continue
                if self.ngram is not None:
                    draft = self.ngram.propose(seq.get_token_ids(), k)
                    self._ngram_drafts[seq.seq_id] = draft
                    k = len(draft)
                seq.num_lookahead_slots = k
                self._planned.append(seq)

    def propose(self, outs: SchedulerOutputs,
                generators: dict[int, torch.Generator]) -> dict[int, list[int]]:
        """The drafts of the scheduled decoding sequences, by sequence id (as many as the
        scheduler left lookahead slots for)."""
        wanted = [(seq, seq.num_lookahead_slots, seq_group.sampling_params, generators[seq.seq_id])
                  for seq_group in outs.decode_seq_groups
                  for seq in seq_group.get_seqs(SequenceStatus.RUNNING)
                  if seq.num_lookahead_slots > 0]
        self._draft_probs = {}
        if self.ngram is not None:
            return {seq.seq_id: self._ngram_drafts[seq.seq_id][:k] for seq, k, *_ in wanted}
        tables = {r.seq_ids[0]: r.block_table for r in outs.seq_runs if not r.is_prompt}
        drafts = {}
        for seq_id, (tokens, q) in self.draft.propose(wanted, tables).items():
            drafts[seq_id] = tokens
            self._draft_probs[seq_id] = q
        return drafts

    def apply(self, logits: torch.Tensor, spec_rows: list[SpecRow],
              generators: dict[int, torch.Generator], output_processor,
              scheduler: Scheduler, stats) -> None:
        """Verify, append the emitted tokens one by one, roll back the rejected slots.

        Args:
            logits: (sum of k + 1, V) the rows of the verifications.
            spec_rows: the verifications, in the order of their rows.
            generators: the sequences' random generators.
            output_processor: appends one token and checks the stops (the engine's).
            scheduler: gives the block tables and frees what the rejected drafts held.
            stats: the engine's ``EngineStats`` (speculation counters).
        """
        if not spec_rows:
            return
        results = verify(logits, spec_rows, generators, self._draft_probs)
        bs = self.block_size
        for row in spec_rows:
            seq_group, seq = row.seq_group, row.seq_group.find(row.seq_id)
            emitted = results[row.seq_id]
            start = seq.get_len()  # position of the first draft
            table = scheduler.get_block_table(seq)
            stats.count_verification(len(row.draft_token_ids), len(emitted))
            self._record_acceptance(row.seq_id, len(row.draft_token_ids), len(emitted) - 1)
            self.last_step[row.seq_id] = {
                "request_id": seq_group.request_id, "proposed": list(row.draft_token_ids),
                "accepted": len(emitted) - 1, "emitted": [o.token_id for o in emitted],
                "lookahead_slots": [table[p // bs] * bs + p % bs
                                    for p in range(start, start + len(row.draft_token_ids))],
                "blocks_before": table}
            for out in emitted:  # one at a time: a stop ends the sequence where it is
                if seq.is_finished():
                    break
                output_processor.process(seq_group, {seq.seq_id: out}, scheduler)
                stats.num_sampled_tokens += 1
            if not seq.is_finished():
                seq.num_computed_tokens = seq.get_len() - 1  # all but the newest are cached
                scheduler.rollback_slots(seq)
                if self.draft is not None:
                    self.draft.accepted(seq)
            self.last_step[row.seq_id]["blocks_after"] = (
                scheduler.get_block_table(seq) if not seq.is_finished() else [])

    def _record_acceptance(self, seq_id: int, proposed: int, accepted: int) -> None:
        """Update the sequence's moving acceptance rate; back off when it is too low."""
        rate, backoff, resume = self._acceptance.get(seq_id, self._fresh)
        rate = 0.5 * rate + 0.5 * accepted / max(proposed, 1)
        if rate < MIN_ACCEPTANCE:
            resume = self.step + backoff
            backoff = min(2 * backoff, MAX_BACKOFF_STEPS)
            rate = MIN_ACCEPTANCE  # after the pause, one good verification lifts it again
        self._acceptance[seq_id] = (rate, backoff, resume)

    def end_step(self) -> None:
        """No lookahead outside a step: sequences preempted or swapped keep none."""
        for seq in self._planned:
            seq.num_lookahead_slots = 0
        self._planned = []

    def forget(self, seqs: list[Sequence]) -> None:
        """These sequences' blocks were freed or moved (finished, preempted)."""
        for seq in seqs:
            if seq.is_finished():
                self._acceptance.pop(seq.seq_id, None)
            if self.draft is not None:
                self.draft.forget(seq.seq_id)


class NoSpeculator:
    """What the engine holds when ``speculative_config`` is None: every call does nothing, so
    that the step reads the same with speculation or without (lesson 08's picture of it)."""

    def __init__(self) -> None:
        self.last_step: dict[int, dict] = {}

    def plan(self, running: list[SequenceGroup], max_model_len: int) -> None:
        pass

    def propose(self, outs: SchedulerOutputs,
                generators: dict[int, torch.Generator]) -> dict[int, list[int]]:
        return {}

    def apply(self, logits, spec_rows, generators, output_processor, scheduler, stats) -> None:
        pass

    def end_step(self) -> None:
        pass

    def forget(self, seqs: list[Sequence]) -> None:
        pass


def make_speculator(config: SpeculativeConfig | None, vocab_size: int, block_size: int,
                    num_gpu_blocks: int, dtype: torch.dtype,
                    device: torch.device) -> Speculator | NoSpeculator:
    """A ``Speculator`` for ``config``, or a ``NoSpeculator`` when it is None.

    Args:
        config: the checked ``speculative_config``, or None (no speculative decoding).
        vocab_size, block_size, num_gpu_blocks, dtype, device: as for ``Speculator``.
    """
    if config is None:
        return NoSpeculator()
    return Speculator(config, vocab_size, block_size, num_gpu_blocks, dtype, device)
