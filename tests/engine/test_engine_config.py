"""Each fact in one place (lesson 08): ``EngineConfig`` declares every setting once and refuses
an unknown one by name; ``ModelShape.from_hf`` reads the shape that transformers and our models
build (checked against transformers' own layers); the KV pool is sized with the bytes its tensors
really take."""
from dataclasses import MISSING, fields

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st

from minipaged import LLM, LLMEngine
from minipaged.config import EngineConfig
from minipaged.model_shape import ModelShape, kv_bytes_per_token
from minipaged.models.gpt2 import GPT2LMHeadModel
from minipaged.models.llama import LlamaForCausalLM
from tiny_models import make_config

pytestmark = pytest.mark.lesson08


def test_every_setting_has_a_default_and_a_help_text():
    for f in fields(EngineConfig):
        assert f.default is not MISSING, f.name
        assert len(f.metadata.get("help", "")) > 10, f.name


def test_no_setting_builds_the_defaults():
    config = EngineConfig.from_settings()
    assert (config.model, config.block_size, config.seed, config.max_num_seqs) == \
        (None, 16, 0, 256)
    assert config.enable_prefix_caching and config.enable_chunked_prefill
    assert not config.enforce_eager and config.worker_timeout == 120.0


@pytest.mark.parametrize("build", [LLMEngine, LLM, EngineConfig.from_settings])
def test_an_unknown_setting_is_refused_by_name_with_the_closest_one(build):
    # (refused before any model is loaded: this costs no time)
    with pytest.raises(TypeError, match=r"'blok_size'.*did you mean 'block_size'"):
        build(None, blok_size=8)
    with pytest.raises(TypeError, match=r"unknown engine setting 'temperature'") as info:
        build(None, num_gpu_blocks=4, temperature=0.5)  # a sampling parameter, not a setting
    assert "did you mean" not in str(info.value)


def test_a_bad_value_still_names_its_setting():
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        EngineConfig.from_settings(block_size=3)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig.from_settings(preemption_mode="evict")


def _on_meta(model_class, config):
    with torch.device("meta"):
        return model_class(config)


def _matrix_weights(model, leave_out=()) -> int:
    return sum(p.numel() for name, p in model.named_parameters()
               if p.dim() == 2 and not name.startswith(leave_out))


def test_gpt2_shape_is_what_the_model_builds():
    config = make_config("gpt2", n_layer=3, n_head=4, n_embd=64, n_inner=96, n_positions=128)
    shape = ModelShape.from_hf(config)
    assert shape == ModelShape(num_layers=3, hidden_size=64, intermediate_size=96, num_heads=4,
                               num_kv_heads=4, head_size=16, vocab_size=256, max_positions=128,
                               gated_mlp=False)
    model = _on_meta(GPT2LMHeadModel, config)
    attn = model.h[0].attn
    assert (len(model.h), attn.num_heads, attn.head_size) == (3, 4, 16)
    assert model.wpe.weight.shape[0] == shape.max_positions
    assert model.h[0].mlp.c_fc.weight.numel() == 64 * 96
    # the matrices a step reads: every layer's, and the tied LM head (the position table is not)
    assert _matrix_weights(model, leave_out=("wpe",)) == shape.weight_params
    reference = _on_meta(transformers.GPT2LMHeadModel, config)  # transformers' own count
    assert _matrix_weights(reference, leave_out=("transformer.wpe",)) == shape.weight_params
    default_width = ModelShape.from_hf(make_config("gpt2", n_embd=64))
    assert default_width.intermediate_size == 4 * 64  # n_inner None: 4 x hidden


def test_llama_gqa_shape_is_what_the_model_builds():
    config = make_config("llama", num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=2, hidden_size=128, intermediate_size=200,
                         tie_word_embeddings=True)
    shape = ModelShape.from_hf(config)
    assert shape == ModelShape(num_layers=3, hidden_size=128, intermediate_size=200,
                               num_heads=8, num_kv_heads=2, head_size=16, vocab_size=256,
                               max_positions=256, gated_mlp=True)
    model = _on_meta(LlamaForCausalLM, config)
    attn = model.layers[0].self_attn
    assert (len(model.layers), attn.num_heads, attn.num_kv_heads, attn.head_size) == (3, 8, 2, 16)
    assert model.layers[0].mlp.gate_proj.weight.numel() == 128 * 200
    assert _matrix_weights(model) == shape.weight_params
    assert _matrix_weights(_on_meta(transformers.LlamaForCausalLM, config)) == shape.weight_params


@settings(max_examples=15, deadline=None)
@given(kv_heads=st.sampled_from([1, 2, 4]), groups=st.sampled_from([1, 3]),
       head_size=st.sampled_from([8, 16, 32]), layers=st.integers(1, 3),
       explicit_head_dim=st.booleans())
def test_llama_shapes_read_once_agree_with_the_model(kv_heads, groups, head_size, layers,
                                                     explicit_head_dim):
    heads = kv_heads * groups
    extra = {"head_dim": head_size} if explicit_head_dim else {}
    # an explicit head_dim need not be hidden / heads: LLaMA's projections say how wide q is
    hidden = heads * head_size * (2 if explicit_head_dim else 1)
    config = make_config("llama", num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, hidden_size=hidden, **extra)
    shape = ModelShape.from_hf(config)
    assert shape.head_size == head_size and shape.num_kv_heads == kv_heads
    reference = _on_meta(transformers.LlamaForCausalLM, config).model  # transformers' widths
    q_proj, k_proj = reference.layers[0].self_attn.q_proj, reference.layers[0].self_attn.k_proj
    assert (len(reference.layers), q_proj.out_features, k_proj.out_features) == \
        (shape.num_layers, shape.num_heads * shape.head_size, shape.num_kv_heads * shape.head_size)
    attn = _on_meta(LlamaForCausalLM, config).layers[0].self_attn  # ours
    assert (attn.num_heads, attn.num_kv_heads, attn.head_size) == \
        (shape.num_heads, shape.num_kv_heads, shape.head_size)
    assert shape.kv_bytes_per_token(4) == 2 * layers * kv_heads * shape.head_size * 4


def test_kv_bytes_per_token_counts_keys_and_values_of_every_layer():
    assert kv_bytes_per_token(num_layers=2, num_kv_heads=3, head_size=4, element_size=2) == 96
    shape = ModelShape.from_hf(make_config("llama"))  # 2 layers, 2 kv heads of 16
    assert shape.kv_bytes_per_token(4) == 2 * 2 * 2 * 16 * 4
    assert shape.kv_bytes_per_token(4, world_size=2) == shape.kv_bytes_per_token(4) // 2


def test_the_pool_is_sized_with_the_bytes_its_tensors_take(tiny_llama):
    engine = LLMEngine(tiny_llama[0], block_size=8, num_gpu_blocks=12, num_cpu_blocks=0,
                       max_model_len=64)
    assert engine.model_shape == ModelShape.from_hf(engine.hf_config)
    cache = engine.worker.cache_engine.gpu_cache
    allocated = sum(t.numel() * t.element_size() for layer in cache for t in layer)
    assert engine.block_bytes * 12 == allocated
    assert engine.block_bytes == 8 * engine.model_shape.kv_bytes_per_token(4)


def test_from_engine_args_builds_the_engine_its_config_describes(tiny_llama):
    """vLLM's ``LLMEngine.from_engine_args``: an ``EngineConfig`` in, the same engine as
    ``LLMEngine(model, **settings)``; anything else is refused by name."""
    from minipaged.config import EngineConfig
    from minipaged.engine.llm_engine import LLMEngine

    path, _ = tiny_llama
    config = EngineConfig.from_settings(path, block_size=8, num_gpu_blocks=12, max_model_len=64,
                                        dtype="float32",
                                        preemption_mode="swap", max_num_seqs=3)
    engine = LLMEngine.from_engine_args(config)
    assert engine.config == config
    assert engine.block_manager.block_size == 8 and engine.scheduler.config.max_num_seqs == 3
    with pytest.raises(TypeError, match="engine_args must be an EngineConfig, got dict"):
        LLMEngine.from_engine_args({"model": path})


def test_the_embedded_model_is_held_as_its_gguf_blocks_where_that_was_measured_faster():
    """Not given, ``quantization`` is "gguf" for the embedded model on one CPU process in
    float32 only (benchmarks/RESULTS.md: faster, the same tokens); "none" everywhere else, and
    what is given is kept. The config keeps what was asked."""
    import torch

    from minipaged.config import EngineConfig
    from minipaged.engine.llm_engine import held_weights

    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def held(model=None, device=cpu, **settings):
        config = EngineConfig.from_settings(model, **settings)
        chosen = held_weights(config, device)
        assert config.quantization == settings.get("quantization")  # (not changed)
        return chosen

    assert held() == held("SmolLM2-135M-Instruct") == held(dtype="float32") == "gguf"
    assert held(quantization="none") == "none" and held(quantization="gguf") == "gguf"
    for settings in (dict(device=cuda), dict(dtype="bfloat16"), dict(dtype="float16"),
                     dict(tensor_parallel_size=2), dict(load_format="dummy"),
                     dict(model="/some/llama_folder"), dict(model="gemma-3-270m")):
        assert held(**settings) == "none", settings
    with pytest.raises(ValueError, match="quantization must be None, 'gguf' or 'none'"):
        EngineConfig.from_settings(None, quantization="float32")
