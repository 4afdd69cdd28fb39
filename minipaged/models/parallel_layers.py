"""Megatron-style tensor-parallel layers (lesson 14).

With N ranks, every rank holds 1/N of each big weight and the ranks talk only twice per layer:

    column-parallel  y_r = x @ W_r        W split by OUTPUT features: each rank gets some heads
                                          (q, k, v) or some MLP columns (up, gate); no talk
    row-parallel     y = sum_r x_r @ W_r  W split by INPUT features: the rank's heads or MLP
                                          columns in, a partial sum out; an all-reduce adds them
    vocab-parallel   the embedding rows and the LM head columns split by token id; an all-reduce
                     (embedding) or an all-gather (logits) puts the whole vocabulary together

The rank and the number of ranks are read from the process's tensor-parallel state when a layer
is built (``tensor_parallel_state``); with one rank (the default) every layer is an ordinary one
and no communication happens. Each parameter knows how to cut its shard out of the full
checkpoint tensor (``param.load_shard``), which ``load_checkpoint_weights`` calls.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minipaged.models import cpu_matmul
from minipaged.models.gguf_linear import GGUFWeight


@dataclass
class TensorParallelState:
    rank: int = 0
    world_size: int = 1


_STATE = TensorParallelState()


def get_tensor_parallel_state() -> TensorParallelState:
    return _STATE


def set_tensor_parallel_state(rank: int, world_size: int) -> None:
    """Called once in each worker, after ``torch.distributed`` is initialised."""
    _STATE.rank, _STATE.world_size = rank, world_size


@contextlib.contextmanager
def tensor_parallel_state(rank: int, world_size: int):
    """Build layers as rank ``rank`` of ``world_size`` would (lesson 14 counts shard sizes)."""
    saved = (_STATE.rank, _STATE.world_size)
    set_tensor_parallel_state(rank, world_size)
    try:
        yield _STATE
    finally:
        set_tensor_parallel_state(*saved)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the ranks, in place (a no-op with one rank)."""
    if _STATE.world_size > 1:
        import torch.distributed as dist

        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dimension (rank order)."""
    if _STATE.world_size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_STATE.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(total: int, world_size: int, what: str) -> int:
    """``total / world_size``, or a ValueError saying what does not split."""
    if total % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide {what} ({total}); "
                         f"choose a tensor_parallel_size that divides it")
    return total // world_size


def _shard(full: torch.Tensor, dim: int, parts: list[int], rank: int, world_size: int):
    """This rank's slice of each of the fused ``parts`` of ``full`` along ``dim``, concatenated.

    A fused q/k/v weight is [q | k | v] along its output dimension; rank r must get
    [q_r | k_r | v_r], not the r-th third of the whole.
    """
    pieces, start = [], 0
    for size in parts:
        per_rank = size // world_size
        pieces.append(full.narrow(dim, start + rank * per_rank, per_rank))
        start += size
    return torch.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def _set_loader(param: nn.Parameter, dim: int | None, parts: list[int]) -> None:
    rank, world_size = _STATE.rank, _STATE.world_size
    if dim is None:  # replicated
        param.load_shard = lambda full: full
    else:
        param.load_shard = lambda full: _shard(full, dim, parts, rank, world_size)


class ColumnParallelLinear(nn.Module):
    """``y_r = x @ W_r + b_r``: this rank's share of the output features, no communication.

    Args:
        in_features, out_features: of the whole (unsplit) layer.
        bias: whether the layer has a bias.
        fused: sizes of the parts fused along the output (GPT-2's ``c_attn`` is [q | k | v]:
            ``[hidden] * 3``); each part is split on its own. Default: one part.
        transposed: weights stored (in, out) as GPT-2's ``Conv1D``, instead of (out, in).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 fused: list[int] | None = None, transposed: bool = False) -> None:
        super().__init__()
        fused = fused or [out_features]
        assert sum(fused) == out_features
        world_size = _STATE.world_size
        for size in fused:
            divide(size, world_size, "the output features of a column-parallel layer")
        self.out_per_rank = out_features // world_size
        self.transposed = transposed
        shape = (in_features, self.out_per_rank) if transposed else (self.out_per_rank,
                                                                     in_features)
        self.weight = nn.Parameter(torch.empty(shape))
        _set_loader(self.weight, 1 if transposed else 0, fused)
        self.bias = nn.Parameter(torch.zeros(self.out_per_rank)) if bias else None
        if bias:
            _set_loader(self.bias, 0, fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in) -> (T, out / N)
        if self.transposed:
            return x @ self.weight if self.bias is None else torch.addmm(self.bias, x,
                                                                         self.weight)
        return cpu_matmul.linear(x, self.weight, self.bias)


class FusedColumns(nn.Module):
    """Column-parallel linears that read the same input, computed as one matmul.

    LLaMA's q, k and v projections (and its MLP's gate and up) each read the same activations.
    Their weights are made consecutive rows of one tensor, each linear's own parameter a view of
    its rows, so one matmul with the whole tensor gives every output at once: one launch
    and one larger matmul (a decode step's matmuls are bound by reading the weights, and a larger
    one reads them at a better rate) instead of two or three. Checkpoints, the state dict and
    code that calls ``q_proj`` alone see nothing different: the fused tensor is no parameter
    (nor are the linears submodules of this one).

    If anything re-binds a weight (``.to()``, ``.half()``), the views no longer point into the
    fused tensor and the linears run one by one, as correct as before (``fused`` says which).

    Args:
        linears: ColumnParallelLinear layers (weights stored (out, in)) with the same input
            size, bias or no bias alike.
    """

    def __init__(self, *linears: ColumnParallelLinear) -> None:
        super().__init__()
        first = linears[0]
        assert all(not l.transposed for l in linears), "(out, in) weights only"
        assert all(l.weight.shape[1] == first.weight.shape[1] for l in linears)
        assert all((l.bias is None) == (first.bias is None) for l in linears)
        self.linears = tuple(linears)  # (a tuple: not registered as submodules here)
        self.sizes = [l.weight.shape[0] for l in linears]
        self.weight = self._share_rows([l.weight for l in linears])
        self.bias = None if first.bias is None else self._share_rows([l.bias for l in linears])
        self._pointers = self._current_pointers()

    def _share_rows(self, params: list[nn.Parameter]) -> torch.Tensor:
        """One tensor holding the parameters' rows; each parameter becomes a view of its rows."""
        whole = torch.cat([p.detach() for p in params])  # (sum of rows, ...)
        for linear, old, rows in zip(self.linears, params, whole.split(self.sizes)):
            new = nn.Parameter(rows, requires_grad=old.requires_grad)
            if hasattr(old, "load_shard"):  # tensor parallel: the same shard of the checkpoint
                new.load_shard = old.load_shard
            setattr(linear, "weight" if old is linear.weight else "bias", new)
        return whole

    def use_weights(self, whole, parts: list) -> None:
        """Hold ``whole`` as the fused weight and ``parts`` (views of its rows) as the linears'
        (a GGUF file's blocks, ``models/gguf_linear.py``); the linears then hold no bias."""
        assert self.bias is None and len(parts) == len(self.linears)
        for linear, part in zip(self.linears, parts):
            if isinstance(linear.weight, nn.Parameter):
                del linear.weight
            linear.weight = part
        self.weight = whole
        self._pointers = self._current_pointers()

    def _current_pointers(self) -> list[int]:
        return [t.data_ptr() for l in self.linears
                for t in ((l.weight,) if l.bias is None else (l.weight, l.bias))]

    @property
    def fused(self) -> bool:
        """Whether every linear's parameters are still views of the fused tensors."""
        return self._current_pointers() == self._pointers

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # (T, in) -> outputs
        if not self.fused:
            return tuple(l(x) for l in self.linears)
        return cpu_matmul.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)  # views

    def extra_repr(self) -> str:
        return f"out_features={self.sizes} in one matmul"


class RowParallelLinear(nn.Module):
    """``y = sum_r x_r @ W_r + b``: this rank's input features in, all-reduced output out.

    The bias is added once, after the all-reduce (each rank holds the whole bias).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 transposed: bool = False) -> None:
        super().__init__()
        self.in_per_rank = divide(in_features, _STATE.world_size,
                                  "the input features of a row-parallel layer")
        self.transposed = transposed
        shape = (self.in_per_rank, out_features) if transposed else (out_features,
                                                                     self.in_per_rank)
        self.weight = nn.Parameter(torch.empty(shape))
        _set_loader(self.weight, 0 if transposed else 1, [in_features])
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if bias:
            _set_loader(self.bias, None, [])

    def partial(self, x: torch.Tensor) -> torch.Tensor:  # (T, in / N) -> (T, out)
        """This rank's term of the sum, before the all-reduce."""
        return x @ self.weight if self.transposed else cpu_matmul.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, in / N) -> (T, out)
        out = all_reduce(self.partial(x))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows (token ids) are split across ranks; also the LM head.

    The vocabulary is padded up to a multiple of N, so every rank holds the same number of
    rows; padded rows are zero and their logits are cut off after the gather.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        world_size, rank = _STATE.world_size, _STATE.rank
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // world_size)  # ceil
        self.start = rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
        start, rows = self.start, self.rows_per_rank

        def load_shard(full: torch.Tensor) -> torch.Tensor:
            shard = full[start:start + rows]
            if shard.shape[0] < rows:  # the last rank's padding rows
                pad = shard.new_zeros(rows - shard.shape[0], *shard.shape[1:])
                shard = torch.cat([shard, pad])
            return shard

        self.weight.load_shard = load_shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        if isinstance(self.weight, GGUFWeight):  # (a GGUF file's blocks: one rank only)
            return self.weight.rows(input_ids)
        if _STATE.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start  # (T,)
        mine = (local >= 0) & (local < self.rows_per_rank)
        out = F.embedding(local.clamp(0, self.rows_per_rank - 1), self.weight)  # (T, hidden)
        out = out * mine.unsqueeze(-1).to(out.dtype)  # other ranks' tokens contribute 0
        return all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (R, hidden) -> (R, vocab)
        """The LM head with these rows as its weight: local columns, then an all-gather."""
        # NOTE: on the CPU the routine is measured as for any linear layer (cpu_matmul): a few
        # rows times a long vocabulary as (R, C) x (C, V) ran 2-3x slower in MKL than other
        # routines for 2 to 32 rows (Gemma 3's 262,144 tokens: 456 ms against 174 ms for 8 rows).
        local = cpu_matmul.linear(hidden, self.weight)  # (R, vocab / N)
        return all_gather_last_dim(local)[:, :self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head (LLaMA's ``lm_head``): vocab-parallel columns and an all-gather."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (R, hidden) -> (R, vocab)
        return self.logits(hidden)


@torch.no_grad()
def copy_shard_from(shard: nn.Module, whole: nn.Module) -> None:
    """Fill a shard's parameters from the same-named ones of the whole module (lesson 14).

    Split parameters cut their slice (``load_shard``); replicated ones (norms) are copied."""
    whole_params = dict(whole.named_parameters())
    for name, p in shard.named_parameters():
        load_shard = getattr(p, "load_shard", None)
        full = whole_params[name]
        p.copy_(load_shard(full) if load_shard is not None else full)
