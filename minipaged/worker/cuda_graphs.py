"""Decode steps replayed from CUDA graphs (lesson 15).

A decode step of a small batch is a few hundred small kernel launches (each layer's matmuls,
norms, rotary, ``reshape_and_cache``, paged attention). On a GPU each kernel finishes in a few
microseconds, about as long as the CPU takes to launch the next one, so the step is bound by
launches rather than by memory or arithmetic. A CUDA graph records all of a step's launches once
and replays them with one call.

A graph replays the same kernels on the same memory addresses. So the step's inputs live in
**static buffers** the graph was captured with, and every step copies its own inputs into them:

- one graph per **padded batch size** (1, 2, 4, 8, 16, ... up to ``max_num_seqs``); a step of
  ``n`` sequences runs the graph of the smallest size >= ``n``;
- the padding rows write nowhere (slot ``-1``) and attend to one token of block 0; their
  outputs are dropped;
- the block-table buffer is as wide as the longest table the model allows,
  ``ceil(max_model_len / block_size)`` entries, so no step's table can overflow it;
- the attention launch is sized for ``max_model_len`` (the longest context it may ever meet),
  while the kernel reads each row's real context length from the buffer.

Only pure decode steps are replayed. Prefill and mixed steps (their token counts vary) run
eagerly, as does a batch larger than the largest graph. ``enforce_eager=True`` turns graphs off.

On the CPU there is nothing to capture, but everything else here runs: ``GraphRunner`` with
``capture=False`` runs the model eagerly *on the static buffers*, so the tests check the padding,
the bucket choice and the buffer width against the ordinary eager step, token for token.
"""
from __future__ import annotations

import torch

from minipaged.models.input_metadata import InputMetadata
from minipaged.worker.model_runner import PreparedInputs

PAD_SLOT = -1  # reshape_and_cache writes nothing for this slot


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes that get a graph: powers of two below ``max_num_seqs``, then it.

    >>> capture_sizes(20)
    [1, 2, 4, 8, 16, 20]
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows, or None (run eagerly)."""
    return next((s for s in sizes if s >= num_seqs), None)


def block_table_width(max_model_len: int, block_size: int) -> int:
    """Entries in the widest block table any sequence can have: ceil(max_model_len / block_size)."""
    return -(-max_model_len // block_size)


def is_decode_only(inputs: PreparedInputs) -> bool:
    """True for a step whose every token is one decoding sequence's newest token."""
    meta = inputs.meta
    return not meta.prompt_lens and meta.num_chunk_tokens == 0 and inputs.input_ids.numel() > 0


class DecodeBuffers:
    """The static inputs of the decode graphs: one set, sized for the largest batch.

    Args:
        max_batch: rows of the largest graph.
        max_model_len: the longest sequence the engine allows (sizes tables and the launch).
        block_size: tokens per block.
        device: where the buffers live (the model's device).
    """

    def __init__(self, max_batch: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.width = block_table_width(max_model_len, block_size)
        kw = dict(device=device)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, **kw)  # (B,)
        self.positions = torch.zeros(max_batch, dtype=torch.long, **kw)  # (B,)
        self.slot_mapping = torch.full((max_batch,), PAD_SLOT, dtype=torch.long, **kw)  # (B,)
        self.block_tables = torch.zeros(max_batch, self.width, dtype=torch.int32, **kw)  # (B, W)
        self.context_lens = torch.ones(max_batch, dtype=torch.int32, **kw)  # (B,)

    def load(self, inputs: PreparedInputs, batch: int) -> None:
        """Copy a decode step's inputs into rows ``[0, n)`` and pad rows ``[n, batch)``.

        Raises:
            ValueError: the step is not decode-only, has more rows than ``batch``, or a block
                table wider than the buffer (a sequence longer than ``max_model_len``).
        """
        if not is_decode_only(inputs):
            raise ValueError("only decode steps replay a graph (this step has prompt tokens)")
        n = inputs.input_ids.numel()
        if not n <= batch <= self.max_batch:
            raise ValueError(f"a decode step of {n} sequences does not fit a graph of {batch} "
                             f"rows (the largest has {self.max_batch})")
        tables = inputs.meta.block_tables  # (n, w)
        if tables.shape[1] > self.width:
            raise ValueError(f"block table of {tables.shape[1]} blocks is wider than the graph's "
                             f"{self.width} (max_model_len {self.max_model_len})")
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(inputs.meta.slot_mapping)
        self.block_tables[:n, :tables.shape[1]].copy_(tables)
        self.block_tables[:n, tables.shape[1]:].zero_()
        self.context_lens[:n].copy_(inputs.meta.context_lens)
        # Padding rows: no token written, one token of block 0 read, output dropped.
        self.input_ids[n:batch].zero_()
        self.positions[n:batch].zero_()
        self.slot_mapping[n:batch].fill_(PAD_SLOT)
        self.block_tables[n:batch].zero_()
        self.context_lens[n:batch].fill_(1)

    def meta(self, batch: int) -> InputMetadata:
        """The attention layers' view of the first ``batch`` rows (views: the graph's addresses)."""
        return InputMetadata(prompt_lens=[], slot_mapping=self.slot_mapping[:batch],
                             block_tables=self.block_tables[:batch],
                             context_lens=self.context_lens[:batch],
                             max_context_len=self.max_model_len)


class GraphRunner:
    """Runs decode steps from captured graphs (or, with ``capture=False``, eagerly on the same
    static buffers, which is how the CPU tests check everything but the capture).

    Args:
        model: the model (``forward(input_ids, positions, kv_caches, meta)``, ``compute_logits``).
        kv_caches: the per-layer (key_cache, value_cache) the graphs read and write; swaps and
            copy-on-write change their contents in place, never their addresses.
        max_num_seqs: the scheduler's batch limit (the largest graph).
        max_model_len, block_size: size the block-table buffer and the attention launch.
        capture: record CUDA graphs (default: when the model is on a CUDA device).
    """

    def __init__(self, model: torch.nn.Module, kv_caches, max_num_seqs: int,
                 max_model_len: int, block_size: int, capture: bool | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = next(model.parameters()).device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = DecodeBuffers(self.sizes[-1], max_model_len, block_size, self.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> (size, vocab) static logits
        self.replays = 0  # steps served from a graph (or from the buffers, capture=False)

    def can_run(self, inputs: PreparedInputs) -> bool:
        """A decode-only step that fits the largest graph."""
        return (is_decode_only(inputs)
                and padded_size(inputs.input_ids.numel(), self.sizes) is not None)

    def _forward(self, batch: int) -> torch.Tensor:  # (batch, vocab) float32
        b = self.buffers
        hidden = self.model(b.input_ids[:batch], b.positions[:batch], self.kv_caches,
                            b.meta(batch))  # (batch, C)
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Record one graph per size, largest first (the smaller ones reuse its memory pool)."""
        if not self.capture:
            return
        pool = None
        for size in reversed(self.sizes):
            self.buffers.block_tables[:size].zero_()
            self.buffers.slot_mapping[:size].fill_(PAD_SLOT)
            self.buffers.context_lens[:size].fill_(1)
            self._forward(size)  # warm-up: lazy initialisation happens outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, inputs: PreparedInputs) -> torch.Tensor:
        """Logits (n, vocab) of a decode step, from its padded graph."""
        n = inputs.input_ids.numel()
        size = padded_size(n, self.sizes)
        if size is None:
            raise ValueError(f"no graph holds {n} sequences (largest {self.sizes[-1]})")
        self.buffers.load(inputs, size)
        self.replays += 1
        if not self.capture:
            return self._forward(size)[:n]
        if size not in self.graphs:
            self.capture_all()
        self.graphs[size].replay()
        return self.outputs[size][:n].clone()

    def release(self) -> None:
        """Forget the graphs and their outputs, so that their private memory pool goes back to
        torch's cache (``LocalWorker.shutdown``); the runner serves no more steps."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.model = self.kv_caches = self.buffers = None
