"""The embedded SmolLM2-135M-Instruct: our engine gives transformers' greedy tokens on the GGUF.

Slow: ~370 s on the 2-core machine (measured at load ~9), the first run dequantizing the embedded
model's GGUF file.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.worker import checkpoint

pytestmark = [pytest.mark.lesson08, pytest.mark.slow]

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Tell me about it."}],
    [{"role": "user", "content": "Write a short story about a robot who learns to paint."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three uses of a paperclip."}],
]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def llm():
    return LLM()


@pytest.fixture(scope="module")
def reference():
    """transformers, loading the GGUF file itself (not our converted cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(checkpoint.embedded_gguf_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint.embedded_model_dir())
    model.generation_config.eos_token_id = None
    return model.eval(), tokenizer


def test_embedded_config_is_the_documented_shape(llm):
    engine = llm.llm_engine
    shape = engine.model_shape
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_size) == \
        (30, 9, 3, 64)
    assert engine.hf_config.tie_word_embeddings
    assert engine.quantization == "gguf"  # LLM()'s default for it on a CPU (issue 58)
    assert engine.hf_config.rope_parameters["rope_theta"] == 100000.0


def test_chat_greedy_matches_transformers_on_the_gguf_weights(llm, reference):
    model, tokenizer = reference
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.chat(CHATS, params, use_tqdm=False)
    for chat, out in zip(CHATS, outs):
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            # NOTE: an explicit attention mask: pad_token_id is 2, which is also <|im_end|>
            # inside every chat prompt, and generate() would otherwise mask those tokens out.
            ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                 max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None)[0, len(ids):].tolist()
        assert len(ref) == NEW_TOKENS
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].text == tokenizer.decode(ref, skip_special_tokens=True)


def test_chat_stops_at_end_of_turn(llm):
    out = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[-1] in llm.llm_engine.eos_token_ids
    assert "Paris" in completion.text


def test_converted_copy_reloads_fast():
    t0 = time.perf_counter()
    LLM()
    assert time.perf_counter() - t0 < 20  # the GGUF conversion alone takes ~30 s


def test_cli_generate_prints_the_answer():
    proc = subprocess.run(
        [sys.executable, "-m", "minipaged", "generate", "What is the capital of France?",
         "--max-tokens", "12"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_cli_reports_bad_arguments_clearly():
    proc = subprocess.run(
        [sys.executable, "-m", "minipaged", "generate", "hi", "--temperature", "-1"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "temperature must be" in proc.stderr


def test_streaming_steps_carry_growing_text(llm):
    engine = llm.llm_engine
    text = llm.get_tokenizer().apply_chat_template(CHATS[1], add_generation_prompt=True,
                                                   tokenize=False)
    engine.add_request("stream", text, SamplingParams(temperature=0, max_tokens=24))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.outputs[0].text)
    assert len(seen) > 3 and seen[-1]
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:]))  # each step extends the text
    assert 0 < len(seen[len(seen) // 2]) < len(seen[-1])  # text arrives before the end
