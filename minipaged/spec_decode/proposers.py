"""Who guesses the next tokens: prompt lookup, or a small draft model (lesson 12).

- ``NgramProposer``: find the latest earlier place where the sequence's last ``n`` tokens
  occurred (``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose the
  tokens that followed it. Plain Python, no model; it proposes nothing when there is no match.
- ``DraftModelProposer``: a smaller model of the same vocabulary proposes ``k`` tokens one by
  one. It runs through the same ``ModelRunner`` and kernels as the target, with its own KV
  tensors (its own ``CacheEngine``, with the draft's layers and heads) addressed by the *same*
  block tables and slots: the target's block manager owns the pages of both models.

NOTE on the draft's KV: the draft remembers, per sequence, how many positions of its own cache
are valid and under which blocks. Before proposing it catches up with one chunk over whatever it
has not seen (the last accepted token, the correction, a prompt). After a preemption, a
swap (its KV is not swapped: it is recomputed), a copy-on-write or a prefix-cache hit, the
blocks differ from those remembered, so it recomputes from the first block that changed.
"""
from __future__ import annotations

import torch

from minipaged.core.block_manager import BlockSpaceManager
from minipaged.model_shape import ModelShape
from minipaged.models.input_metadata import InputMetadata
from minipaged.sequence import Sequence
from minipaged.worker import checkpoint
from minipaged.worker.cache_engine import CacheEngine
from minipaged.worker.model_loader import build_model
from minipaged.worker.model_runner import ModelRunner, PreparedInputs
from minipaged.worker.sampler import draw, top_k_top_p_filter


class NgramProposer:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens.

    Args:
        prompt_lookup_max, prompt_lookup_min: the n-gram lengths tried, longest first.
    """

    def __init__(self, prompt_lookup_max: int, prompt_lookup_min: int) -> None:
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the last n tokens."""
        if k <= 0:
            return []
        length = len(token_ids)
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1, -1):
            pattern = token_ids[length - n:]
            # latest start first; the match must end before the last token (earlier occurrence)
            for start in range(length - n - 1, -1, -1):
                if token_ids[start:start + n] == pattern:
                    return token_ids[start + n:start + n + k]
        return []


class DraftModelProposer:
    """A small model proposes ``k`` tokens per sequence, reading its own KV in the shared pages.

    Args:
        model: the draft's path or hub id (``speculative_config.model``).
        target_vocab_size: the target's vocabulary; the draft's must be the same.
        block_size, num_gpu_blocks: the target's pool: the draft's cache has the same blocks.
        dtype, device: as the target's.
    """

    def __init__(self, model: str, target_vocab_size: int, block_size: int,
                 num_gpu_blocks: int, dtype: torch.dtype, device: torch.device) -> None:
        try:
            source = checkpoint.resolve(model)
            hf = checkpoint.load_config(source)
        except (ValueError, OSError) as e:
            raise ValueError(f"speculative_config.model: cannot load the draft model "
                             f"{model!r}: {e}") from e
        if hf.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has "
                             f"{hf.vocab_size} tokens, the target's {target_vocab_size}; "
                             f"they must be the same")
        try:
            self.model = build_model(hf, source, "auto", dtype, device)
        except (ValueError, OSError, KeyError) as e:
            raise ValueError(f"speculative_config.model: cannot load the draft model "
                             f"{model!r}: {e}") from e
        self.runner = ModelRunner(self.model)
        shape = ModelShape.from_hf(hf)
        self.cache = CacheEngine(shape.num_layers, shape.num_kv_heads, shape.head_size,
                                 block_size, num_gpu_blocks, 0, dtype, device)
        self.block_size = block_size
        self.device = device
        # seq_id -> (positions of the draft's cache that hold valid KV, the blocks they are in)
        self.valid: dict[int, tuple[int, list[int]]] = {}

    def forget(self, seq_id: int) -> None:
        """The sequence's blocks were freed or moved: its draft KV is gone."""
        self.valid.pop(seq_id, None)

    def accepted(self, seq: Sequence) -> None:
        """After verification: draft KV past the accepted tokens is stale."""
        if seq.seq_id in self.valid:
            n, blocks = self.valid[seq.seq_id]
            self.valid[seq.seq_id] = (min(n, seq.num_computed_tokens), blocks)

    def _num_valid(self, seq: Sequence, table: list[int]) -> int:
        n, blocks = self.valid.get(seq.seq_id, (0, []))
        same = 0  # leading blocks still the same as when the draft wrote them
        while same < min(len(blocks), len(table)) and blocks[same] == table[same]:
            same += 1
        return min(n, same * self.block_size)

    def propose(self, requests: list[tuple[Sequence, int, object, torch.Generator]],
                block_manager: BlockSpaceManager
                ) -> dict[int, tuple[list[int], torch.Tensor | None]]:
        """Draft tokens for each ``(sequence, k, sampling params, generator)``, all sequences
        batched in each of the ``k`` forward passes.

        Returns per sequence id ``(tokens, q)``: ``q`` (k, V) the draft's distributions the
        tokens were drawn from, None for a greedy request (the draft's argmax).
        """
        requests = [r for r in requests if r[1] > 0]
        tables = {seq.seq_id: block_manager.get_block_table(seq) for seq, *_ in requests}
        # The first pass catches up: every token the draft has not seen, up to the newest.
        pieces = []
        for seq, _, _, _ in requests:
            start = self._num_valid(seq, tables[seq.seq_id])
            pieces.append(seq.get_token_ids()[start:])
        out: dict[int, tuple[list[int], list[torch.Tensor]]] = {
            seq.seq_id: ([], []) for seq, *_ in requests}
        for step in range(max((r[1] for r in requests), default=0)):
            active = [(r, p) for r, p in zip(requests, pieces) if r[1] > step]
            logits = self._run([(seq, p, tables[seq.seq_id]) for (seq, *_), p in active])
            for row, ((seq, _, params, generator), _) in enumerate(active):
                token, q = self._choose(logits[row], params, generator)
                out[seq.seq_id][0].append(token)
                out[seq.seq_id][1].append(q)
            pieces = [[out[seq.seq_id][0][-1]] for (seq, *_), _ in active]
            requests = [r for r, _ in active]
        return {seq_id: (tokens, None if qs[0] is None else torch.stack(qs))
                for seq_id, (tokens, qs) in out.items()}

    @staticmethod
    def _choose(logits: torch.Tensor, params, generator) -> tuple[int, torch.Tensor | None]:
        """The draft's token from one row of logits (V,): argmax for greedy requests, else a
        draw from its distribution after temperature, top-k and top-p (returned as ``q``)."""
        if params.greedy:
            return int(torch.argmax(logits)), None
        probs = torch.softmax(top_k_top_p_filter(logits / params.temperature, params.top_k,
                                                 params.top_p), dim=-1)  # (V,)
        return draw(probs, generator), probs

    def _run(self, pieces: list[tuple[Sequence, list[int], list[int]]]) -> torch.Tensor:
        """One forward pass of the draft: each piece continues its sequence's cached draft KV as
        a chunk; returns the logits (num pieces, V) of each piece's last token."""
        bs = self.block_size
        ids, positions, slots, loc, ends, tables, last = [], [], [], [0], [], [], []
        for seq, tokens, table in pieces:
            start = self._num_valid(seq, table)
            t = torch.tensor(table)  # (num_blocks,)
            pos = torch.arange(start, start + len(tokens))  # (n,)
            ids += tokens
            positions.append(pos)
            slots.append(t[pos // bs] * bs + pos % bs)  # (n,)
            loc.append(loc[-1] + len(tokens))
            ends.append(start + len(tokens))
            tables.append(table)
            last.append(len(ids) - 1)
            self.valid[seq.seq_id] = (start + len(tokens), list(table))
        width = max(len(t) for t in tables)
        meta = InputMetadata(
            prompt_lens=[], slot_mapping=torch.cat(slots).to(self.device),
            block_tables=torch.zeros(0, 0, dtype=torch.int32, device=self.device),
            context_lens=torch.zeros(0, dtype=torch.int32, device=self.device),
            max_context_len=0,
            chunk_query_start_loc=torch.tensor(loc, dtype=torch.int32, device=self.device),
            chunk_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                            dtype=torch.int32, device=self.device),
            chunk_context_lens=torch.tensor(ends, dtype=torch.int32, device=self.device),
            num_chunk_tokens=len(ids))
        inputs = PreparedInputs(torch.tensor(ids, device=self.device),
                                torch.cat(positions).to(self.device), meta, [],
                                torch.tensor(last, device=self.device), [])
        return self.runner.execute_model(inputs, self.cache.gpu_cache).cpu()  # (pieces, V)
