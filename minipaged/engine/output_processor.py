"""After the sampler: new tokens join their sequences, beams fork, stops end sequences (lesson 08).

For each group the step sampled, in this order:

1. beam search: a sequence whose beam was dropped becomes a copy of its new parent (its blocks
   are freed and it shares the parent's, copy-on-write);
2. each sequence appends its token, its text grows (incremental detokenization), and the stop
   checks run: a stop string, the end-of-sequence token, ``max_tokens``, ``max_model_len``;
3. a finished sequence frees its blocks; a finished group gets its final text.
"""
from __future__ import annotations

from minipaged.core.scheduler import Scheduler
from minipaged.engine.detokenizer import detokenize_incrementally
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.worker.sampler import SequenceOutput


def eos_token_ids(hf_config, tokenizer) -> set[int]:
    """The token ids that end a sequence: the model config's and the tokenizer's."""
    ids = set()
    for value in (getattr(hf_config, "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


class OutputProcessor:
    """Applies a step's sampled tokens to their sequences.

    Args:
        tokenizer: turns tokens into text (None: no text, and no stop strings).
        eos_token_ids: the tokens that end a sequence unless ``ignore_eos``.
        max_model_len: no sequence grows longer than this.
    """

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def process(self, seq_group: SequenceGroup, outputs: dict[int, SequenceOutput],
                scheduler: Scheduler) -> None:
        """Append one step's tokens to ``seq_group``'s sequences and end those that are done.

        Args:
            seq_group: a group the step sampled.
            outputs: its sampled tokens, by sequence id.
            scheduler: frees and forks the sequences' blocks.
        """
        # 1. Beam search: a sequence whose beam was dropped becomes a copy of its new parent.
        for seq_id, out in outputs.items():
            if out.parent_seq_id != seq_id:
                seq, parent = seq_group.find(seq_id), seq_group.find(out.parent_seq_id)
                scheduler.free_seq(seq)
                seq.copy_state_from(parent)
                scheduler.fork_seq(parent, seq)
        # 2. Append the new tokens, then check whether each sequence is done.
        params = seq_group.sampling_params
        for seq_id, out in outputs.items():
            seq = seq_group.find(seq_id)
            seq.append_token_id(out.token_id, out.logprobs)
            self.check_stop(seq, params)
            if seq.is_finished():
                scheduler.free_seq(seq)
        if seq_group.is_finished():
            self.detokenize_all(seq_group)

    def check_stop(self, seq: Sequence, params: SamplingParams) -> None:
        """Mark ``seq`` finished if its newest token ends it (and grow its text)."""
        if self.tokenizer is not None:  # (validate_request refuses stop strings without one)
            previous = len(seq.output_text)
            detokenize_incrementally(self.tokenizer, seq)  # streamed outputs carry text too
            if params.stop_strings:
                # A stop string may straddle the old text and the new: search a little way back.
                start = max(0, previous - max(len(s) for s in params.stop_strings) + 1)
                hits = [i for s in params.stop_strings
                        if (i := seq.output_text.find(s, start)) != -1]
                if hits:
                    seq.output_text = seq.output_text[:min(hits)]  # the stop string is dropped
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    return
        if not params.ignore_eos and seq.get_last_token_id() in self.eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
        elif seq.get_output_len() >= params.max_tokens or seq.get_len() >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    def detokenize_all(self, seq_group: SequenceGroup) -> None:
        """The final text of each of ``seq_group``'s sequences, decoded whole."""
        for seq in seq_group.get_seqs():
            if not (seq.status is SequenceStatus.FINISHED_STOPPED
                    and seq_group.sampling_params.stop_strings):
                seq.output_text = self._decode(seq.output_token_ids)
            if seq.status is not SequenceStatus.FINISHED_STOPPED:
                # Cut off by max_tokens (or an abort) inside a multi-byte character: drop the
                # half character rather than end the text with U+FFFD.
                seq.output_text = seq.output_text.rstrip("\ufffd")

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
