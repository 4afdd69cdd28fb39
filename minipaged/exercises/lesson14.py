"""Lesson 14 exercises: cutting a weight for tensor parallelism, and the all-reduce.

Weights are stored as ``nn.Linear`` stores them: ``(out_features, in_features)``.

    shard_weight(weight, kind, rank, world_size, parts=None) -> tensor
        rank ``rank``'s slice of ``weight`` for a "column"-parallel layer (split by output
        features) or a "row"-parallel layer (split by input features). ``parts`` lists the sizes
        of layers fused along the output (GPT-2's ``c_attn`` is [q | k | v]: ``[768] * 3``);
        each part is split on its own. ``None``: one part.
    row_parallel(x, weight, bias, world_size) -> (partials, output)
        a row-parallel layer run on ``world_size`` ranks, by hand: rank r gets its slice of the
        input features of ``x`` (T, in) and its shard of ``weight``; ``partials`` is the list of
        the ranks' (T, out) products before the all-reduce, ``output`` what every rank holds
        after it, bias included.

Expected answers: the ``load_shard`` of the real ``ColumnParallelLinear`` / ``RowParallelLinear``
built as rank r of N (``tensor_parallel_state``); their ``partial`` on each rank's shard; and
the whole, unsplit layer (``F.linear``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.models.parallel_layers import (ColumnParallelLinear, RowParallelLinear,
                                              tensor_parallel_state)


def _layer(kind: str, in_features: int, out_features: int, rank: int, world_size: int,
           parts=None, bias: bool = False):
    with tensor_parallel_state(rank, world_size):
        if kind == "column":
            return ColumnParallelLinear(in_features, out_features, bias=bias, fused=parts)
        return RowParallelLinear(in_features, out_features, bias=bias)


def _describe(t: torch.Tensor) -> str:
    return f"<tensor {tuple(t.shape)}>"


class _Shown(str):
    """A description that the failure message prints as it is (no quotes)."""

    def __repr__(self) -> str:
        return str(self)


def _which_entries(t) -> str:
    """A slice of the checker's weight (entry [i, j] = 100 i + j) as the rows and columns of
    the whole weight it holds."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or 0 in t.shape:
        return repr(t)
    rows = [int(v) // 100 for v in t[:, 0].tolist()]
    cols = [int(v) % 100 for v in t[0, :].tolist()]
    return _Shown(f"{tuple(t.shape)}: rows {rows} x columns {cols} of the whole weight")


def _values(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)
    return _Shown(f"{tuple(t.shape)} {[round(v, 4) for v in t.flatten().tolist()[:6]]}"
                  + (" ..." if t.numel() > 6 else ""))


@exercise
def check_shard_weight(fn, num_cases: int = 120, seed: int | None = 0) -> CheckResult:
    learner = Learner("shard_weight", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        world_size = rng.choice([1, 2, 3, 4])
        kind = rng.choice(["column", "row"])
        in_features = world_size * rng.randint(1, 4)
        parts = None
        if kind == "column" and case % 3:
            parts = [world_size * rng.randint(1, 3) for _ in range(rng.choice([2, 3]))]
            out_features = sum(parts)
        else:
            out_features = world_size * rng.randint(1, 4)
        rank = rng.randrange(world_size)
        # Entries that say where they come from: row i, column j holds 100 * i + j.
        weight = (100 * torch.arange(out_features)[:, None] + torch.arange(in_features)).float()
        expected = _layer(kind, in_features, out_features, rank, world_size,
                          parts).weight.load_shard(weight)
        got = learner(weight.clone(), kind, rank, world_size, parts)
        if not (isinstance(got, torch.Tensor) and got.shape == expected.shape
                and torch.equal(got, expected)):
            if kind == "row":
                hint = ("a row-parallel layer is split by INPUT features: the weight's columns "
                        "(dim 1), rank r taking the r-th of N equal ranges")
            elif parts and isinstance(got, torch.Tensor) and got.shape == expected.shape:
                hint = ("with fused parts, cut each part on its own and put the rank's slices "
                        "side by side: rank r needs [q_r | k_r | v_r], not the r-th third of "
                        "[q | k | v]")
            else:
                hint = ("a column-parallel layer is split by OUTPUT features: the weight's rows "
                        "(dim 0), rank r taking the r-th of N equal ranges")
            fail(learner.name, case, f"weight={_describe(weight)} (entry [i, j] = 100 i + j), "
                 f"kind={kind!r}, rank={rank}, world_size={world_size}, parts={parts}",
                 _which_entries(got), _which_entries(expected), hint)
    return passed(learner, num_cases)


@exercise
def check_row_parallel(fn, num_cases: int = 80, seed: int | None = 0) -> CheckResult:
    learner = Learner("row_parallel", fn)
    rng = rng_for(seed)
    gen = torch.Generator().manual_seed(0 if seed is None else seed)
    for case in range(num_cases):
        world_size = rng.choice([1, 2, 3, 4])
        in_features = world_size * rng.randint(1, 5)
        out_features, tokens = rng.randint(1, 6), rng.randint(1, 4)
        x = torch.randn(tokens, in_features, generator=gen, dtype=torch.float64)
        weight = torch.randn(out_features, in_features, generator=gen, dtype=torch.float64)
        bias = torch.randn(out_features, generator=gen, dtype=torch.float64)
        # The package: each rank's RowParallelLinear, its shard cut by load_shard, its partial.
        per_rank = in_features // world_size
        expected_partials = []
        for rank in range(world_size):
            layer = _layer("row", in_features, out_features, rank, world_size, bias=True).double()
            with torch.no_grad():
                layer.weight.copy_(layer.weight.load_shard(weight))
            x_r = x[:, rank * per_rank:(rank + 1) * per_rank]
            expected_partials.append(layer.partial(x_r).detach())
        whole = F.linear(x, weight, bias)  # the layer without tensor parallelism
        inputs = (f"x={_describe(x)}, weight={_describe(weight)}, bias={_describe(bias)}, "
                  f"world_size={world_size}")
        got = learner(x.clone(), weight.clone(), bias.clone(), world_size)
        partials, output = got if isinstance(got, (tuple, list)) and len(got) == 2 else (None,
                                                                                         None)
        if not isinstance(partials, (list, tuple)) or len(partials) != world_size:
            fail(learner.name, case, inputs, type(partials).__name__, f"a list of {world_size} "
                 f"tensors", "return (partials, output): one partial product per rank")
        for rank, (p, e) in enumerate(zip(partials, expected_partials)):
            if not (isinstance(p, torch.Tensor) and p.shape == e.shape
                    and torch.allclose(p.double(), e, atol=1e-9)):
                hint = (f"rank {rank} multiplies ITS slice of x's features (columns "
                        f"{rank * per_rank}..{(rank + 1) * per_rank - 1}) by ITS shard of the "
                        f"weight (the same columns of the weight): a (T, out) partial sum")
                if isinstance(p, torch.Tensor) and p.shape == e.shape and torch.allclose(
                        p.double(), e + bias, atol=1e-9):
                    hint = ("no bias in the partial sums: every rank holds the whole bias, and "
                            "the all-reduce would add it N times")
                fail(learner.name, case, inputs + f" (rank {rank}'s partial)", _values(p),
                     _values(e), hint)
        if not (isinstance(output, torch.Tensor) and output.shape == whole.shape
                and torch.allclose(output.double(), whole, atol=1e-9)):
            hint = "the all-reduce adds the ranks' partial sums; then the bias is added once"
            if isinstance(output, torch.Tensor) and output.shape == whole.shape and \
                    torch.allclose(output.double(), whole + (world_size - 1) * bias, atol=1e-9):
                hint = (f"the bias was added {world_size} times: add it once, after the "
                        f"all-reduce")
            fail(learner.name, case, inputs + " (output)", _values(output), _values(whole), hint)
    return passed(learner, num_cases)


__all__ = ["check_shard_weight", "check_row_parallel"]
