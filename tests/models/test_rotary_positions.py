"""The rotary tables hold the positions the engine uses (``models/rotary.fit_positions``): an
engine's model keeps ``max_model_len`` rows, not the model's ``max_position_embeddings``; a cut
table is the first rows of the whole one, bit for bit, layers that shared a table still share it,
and a table can grow back (computed again, equal to the first build)."""
import types

import torch

from minipaged import LLM
from minipaged.models.rotary import RotaryEmbedding, fit_positions


def rotaries(model) -> list[RotaryEmbedding]:
    return [m for m in model.modules() if isinstance(m, RotaryEmbedding)]


def test_an_engine_s_tables_hold_its_max_model_len(tiny_llama):
    path, hf = tiny_llama
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, num_gpu_blocks=16,
              max_model_len=48)
    tables = rotaries(llm.llm_engine.worker.model)
    assert hf.config.max_position_embeddings > 48
    assert tables and {t.num_positions for t in tables} == {48}
    assert len({t.cos_cache.data_ptr() for t in tables}) == 1  # one table for all layers


def test_cut_tables_are_the_first_rows_and_stay_shared():
    config = types.SimpleNamespace(rope_theta=10000.0)
    layers = torch.nn.ModuleList(RotaryEmbedding(config, 16, 512) for _ in range(3))
    whole_cos, whole_sin = layers[0].cos_cache, layers[0].sin_cache
    for layer in layers[1:]:
        layer.cos_cache, layer.sin_cache = whole_cos, whole_sin
    fit_positions(layers, 40)
    assert all(layer.num_positions == 40 for layer in layers)
    assert len({layer.cos_cache.data_ptr() for layer in layers}) == 1
    assert layers[0].cos_cache.untyped_storage().nbytes() == 40 * 16 * 4  # (a copy: memory back)
    assert torch.equal(layers[0].cos_cache, whole_cos[:40])
    assert torch.equal(layers[0].sin_cache, whole_sin[:40])
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    positions = torch.tensor([0, 3, 17, 38, 39])
    fresh = RotaryEmbedding(config, 16, 512)
    for got, want in zip(layers[1](positions, q, k), fresh(positions, q, k)):
        assert torch.equal(got, want)
    fit_positions(layers, 10**6)  # back to the model's positions, no more
    assert layers[2].num_positions == 512 and torch.equal(layers[2].cos_cache, whole_cos)
