"""Qwen2, Qwen3, Mistral and Gemma 3 as diffs of our LLaMA: transformers' logits and greedy
tokens on tiny random checkpoints, prompts longer than the sliding window (8 tokens)."""
import random

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.engine.llm_engine import LLMEngine
from paged_forward import teacher_forced_logits
from tiny_models import FAMILIES, WINDOW, greedy_reference, make_config, pick_prompts, \
    save_tiny_model

pytestmark = [pytest.mark.lesson07, pytest.mark.lesson08]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(kind, directory, transformers model) of one tiny family checkpoint."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, str(path), save_tiny_model(request.param, path, seed=5)


@pytest.mark.parametrize("block_size,num_prefill", [(4, 7), (16, 30)])
def test_teacher_forced_logits_match_transformers(family, block_size, num_prefill):
    """A packed prefill (shorter or longer than the window), then paged decode past it."""
    kind, path, hf = family
    engine = LLMEngine(path, block_size=block_size, num_gpu_blocks=64, dtype="float32")
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (40, 31, 35)]
    ours = teacher_forced_logits(engine, prompts, num_prefill=num_prefill,
                                 block_size=block_size)
    for p, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]  # (len, vocab)
        assert ref.abs().max() > 1.0
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


NEW_TOKENS = 12


@pytest.fixture(scope="module")
def greedy_case(family):
    """The family's prompts (2-3 windows long; the third shares the first's first 12 tokens)
    and transformers' greedy tokens for each."""
    kind, path, hf = family
    prompts = pick_prompts(hf, [19, 23], NEW_TOKENS, seed=2)
    prompts.append(prompts[0][:12] + prompts[1][:9])
    return prompts, [greedy_reference(hf, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("mode", ["plain", "chunked", "prefix_cached"])
def test_greedy_tokens_match_transformers(family, greedy_case, mode):
    """The engine's greedy tokens: prompts whole, in chunks of 5 tokens, or after a cached
    prefix."""
    kind, path, hf = family
    new = NEW_TOKENS
    prompts, expected = greedy_case
    settings = dict(block_size=4, num_gpu_blocks=128, dtype="float32", seed=0)
    if mode == "chunked":
        settings.update(enable_chunked_prefill=True, max_num_batched_tokens=5, max_num_seqs=2)
    if mode == "prefix_cached":
        settings.update(enable_prefix_caching=True)
    llm = LLM(path, **settings)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    if mode == "prefix_cached":  # the first prompt fills the cache, the others find it
        llm.generate(prompt_token_ids=prompts[:1], sampling_params=params, use_tqdm=False)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    for want, out in zip(expected, outs):
        assert out.outputs[0].token_ids == want, (kind, mode)
    if mode == "prefix_cached":
        assert llm.llm_engine.scheduler.block_manager.num_cached_tokens > 0


def test_windows_read_from_the_config():
    from minipaged.model_shape import ModelShape

    assert ModelShape.from_hf(make_config("mistral")).windows == (WINDOW, WINDOW)
    assert ModelShape.from_hf(make_config("qwen2_window")).windows == (None, WINDOW)
    assert ModelShape.from_hf(make_config("qwen3")).windows == (None, None)
    assert ModelShape.from_hf(make_config("gemma3")).windows == (WINDOW, None, WINDOW)
    assert ModelShape.from_hf(make_config("mistral")).uniform_window == WINDOW
    assert ModelShape.from_hf(make_config("gemma3")).uniform_window is None


@pytest.mark.parametrize("kind,overrides,message", [
    ("gemma3", dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     "chunked_attention"),
    ("gemma3", dict(layer_types=["sliding_attention", "full_attention"]), "names 2 layers"),
    ("gemma3", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("gemma3", dict(use_bidirectional_attention=True), "bidirectional"),
    ("mistral", dict(sliding_window=0), "sliding_window must be a positive"),
    ("qwen3", dict(hidden_act="relu"), "unsupported hidden activation 'relu'"),
])
def test_bad_configs_are_refused(tmp_path, kind, overrides, message):
    from minipaged.models.registry import get_model_class
    from minipaged.worker.model_loader import build_model

    config = make_config(kind)
    for key, value in overrides.items():
        setattr(config, key, value)  # after construction: the config classes would fix some
    with pytest.raises(ValueError, match=message):
        build_model(config, None, "dummy", torch.float32, torch.device("cpu"))
    if "layer_types" in overrides or "sliding_window" in overrides:
        with pytest.raises(ValueError, match=message):
            get_model_class(config)


def test_unknown_family_is_refused():
    from transformers import PhiConfig

    from minipaged.models.registry import get_model_class

    with pytest.raises(ValueError, match="model_type 'phi' is not supported"):
        get_model_class(PhiConfig())


def test_gemma3_final_logit_softcapping(tmp_path):
    """Gemma's optional soft cap of the output logits, tanh(logits / cap) * cap."""
    hf = save_tiny_model("gemma3", tmp_path, seed=7, final_logit_softcapping=3.0)
    engine = LLMEngine(str(tmp_path), block_size=4, num_gpu_blocks=64, dtype="float32")
    prompt = list(range(5, 35))
    (ours,) = teacher_forced_logits(engine, [prompt], num_prefill=12, block_size=4)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert ref.abs().max() <= 3.0
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
