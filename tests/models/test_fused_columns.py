"""LLaMA's q/k/v and gate/up projections as one matmul each (models/parallel_layers.FusedColumns).

The linears keep their own parameters (views of one tensor): the state dict, checkpoint loading,
tensor-parallel shards and code that calls ``q_proj`` alone are unchanged; a re-bound weight
(``.to()``) makes the layer run the linears one by one, never read a stale tensor.
"""
from __future__ import annotations

import torch
from transformers import LlamaConfig

from minipaged.models.llama import LlamaAttention, LlamaMLP
from minipaged.models.parallel_layers import (ColumnParallelLinear, FusedColumns,
                                              copy_shard_from, tensor_parallel_state)


def config(**kw) -> LlamaConfig:
    settings = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=1, vocab_size=50)
    settings.update(kw)
    return LlamaConfig(**settings)


def test_the_linears_become_views_of_one_tensor_and_one_matmul_gives_their_outputs():
    torch.manual_seed(0)
    linears = [ColumnParallelLinear(16, n, bias=True) for n in (8, 4, 4)]
    with torch.no_grad():
        for l in linears:
            l.weight.normal_()
            l.bias.normal_()
    before = [(l.weight.clone(), l.bias.clone()) for l in linears]
    fused = FusedColumns(*linears)
    assert fused.fused and fused.weight.shape == (16, 16) and fused.bias.shape == (16,)
    for l, (w, b) in zip(linears, before):  # the same numbers, now inside the fused tensors
        assert torch.equal(l.weight, w) and torch.equal(l.bias, b)
        assert l.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()
    x = torch.randn(5, 16)
    for ours, l in zip(fused(x), linears):
        torch.testing.assert_close(ours, l(x))
    with torch.no_grad():  # writing a linear's weight in place writes the fused tensor
        linears[1].weight.fill_(2.0)
    assert (fused.weight[8:12] == 2.0).all()


def test_a_rebound_weight_makes_the_linears_run_one_by_one():
    torch.manual_seed(1)
    mlp = LlamaMLP(config())
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
    x = torch.randn(3, 64, dtype=torch.float64)
    mlp.to(torch.float64)  # new tensors: the fused one is stale now
    assert not mlp.gate_up.fused
    expected = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.equal(mlp(x), expected)


def test_state_dict_names_and_sizes_are_the_checkpoints():
    attn = LlamaAttention(config())
    names = {n: tuple(t.shape) for n, t in attn.state_dict().items()}
    assert names == {"q_proj.weight": (64, 64), "k_proj.weight": (32, 64),
                     "v_proj.weight": (32, 64), "o_proj.weight": (64, 64)}
    # the fused tensor is no extra parameter: the weights are counted once
    assert sum(p.numel() for p in attn.parameters()) == 64 * 64 * 2 + 32 * 64 * 2


def test_tensor_parallel_shards_fuse_their_own_heads():
    """Rank r's fused weight is [q_r | k_r | v_r], and its outputs are rank r's heads."""
    torch.manual_seed(2)
    cfg = config()
    whole = LlamaAttention(cfg)
    with torch.no_grad():
        for p in whole.parameters():
            p.normal_()
    x = torch.randn(4, 64)
    full_q, full_k, full_v = (l(x) for l in (whole.q_proj, whole.k_proj, whole.v_proj))
    for rank in range(2):
        with tensor_parallel_state(rank, 2):
            shard = LlamaAttention(cfg)
        copy_shard_from(shard, whole)
        assert shard.qkv.fused
        q, k, v = shard.qkv(x)
        torch.testing.assert_close(q, full_q[:, 32 * rank:32 * (rank + 1)])
        torch.testing.assert_close(k, full_k[:, 16 * rank:16 * (rank + 1)])
        torch.testing.assert_close(v, full_v[:, 16 * rank:16 * (rank + 1)])


def test_the_step_breakdown_counts_a_fused_call_once_fused_or_not():
    """lab/step_breakdown times linear layers by forward hooks: a FusedColumns call is one
    linear call whose FLOPs are its linears' together, also when it runs them one by one."""
    from minipaged.lab.step_breakdown import _Instruments

    torch.manual_seed(3)
    mlp = LlamaMLP(config())
    x = torch.randn(5, 64)
    flops = []
    for rebind in (False, True):
        if rebind:
            mlp.to(torch.float64)
            x = x.double()
        mlp.compute_logits = lambda hidden: hidden  # (_Instruments wraps a model's, then drops it)
        tools = _Instruments(mlp, lambda: None)
        try:
            mlp.gate_up(x)
        finally:
            tools.remove()
        assert mlp.gate_up.fused is not rebind
        flops.append(tools.flops["linear"])
    assert flops == [2.0 * 5 * 64 * 96 * 2] * 2  # gate and up, 64 -> 96 each, 5 rows, once
