"""Lessons 07 and 08: our GPT-2 and LLaMA give transformers' logits, through prefill and paged decode."""
import random

import pytest
import torch

from minipaged.engine.llm_engine import LLMEngine
from minipaged.models.input_metadata import InputMetadata

pytestmark = [pytest.mark.lesson07, pytest.mark.lesson08]


def prefill_meta(lengths, slots):
    return InputMetadata(list(lengths), torch.tensor(slots, dtype=torch.long),
                         torch.zeros(0, 0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0)


@torch.no_grad()
def teacher_forced_logits(engine, prompts, num_prefill, block_size, seed=0):
    """Prefill the first ``num_prefill`` tokens of every prompt in one packed batch, then feed the
    rest one token per step, all sequences decoding together. Each sequence's blocks are a
    shuffled, non-contiguous set of physical blocks. Returns logits (len, vocab) per prompt."""
    rng = random.Random(seed)
    caches = engine.worker.cache_engine.gpu_cache
    free = list(range(engine.worker.cache_engine.num_gpu_blocks))
    rng.shuffle(free)
    tables = []
    for p in prompts:
        n = -(-len(p) // block_size)
        tables.append([free.pop() for _ in range(n)])

    def slot(i, pos):
        return tables[i][pos // block_size] * block_size + pos % block_size

    model = engine.worker.model
    ids, pos, slots = [], [], []
    for i, p in enumerate(prompts):
        ids += p[:num_prefill]
        pos += range(num_prefill)
        slots += [slot(i, t) for t in range(num_prefill)]
    meta = prefill_meta([num_prefill] * len(prompts), slots)
    hidden = model(torch.tensor(ids), torch.tensor(pos), caches, meta)
    logits = model.compute_logits(hidden).view(len(prompts), num_prefill, -1)
    out = [[logits[i, t] for t in range(num_prefill)] for i in range(len(prompts))]
    for t in range(num_prefill, max(len(p) for p in prompts)):
        active = [i for i, p in enumerate(prompts) if t < len(p)]
        max_blocks = max(len(tables[i]) for i in active)
        meta = InputMetadata(
            [], torch.tensor([slot(i, t) for i in active]),
            torch.tensor([tables[i] + [0] * (max_blocks - len(tables[i])) for i in active],
                         dtype=torch.int32),
            torch.tensor([t + 1] * len(active), dtype=torch.int32), t + 1)
        hidden = model(torch.tensor([prompts[i][t] for i in active]),
                       torch.tensor([t] * len(active)), caches, meta)
        logits = model.compute_logits(hidden)
        for row, i in enumerate(active):
            out[i].append(logits[row])
    return [torch.stack(o) for o in out]


@pytest.mark.parametrize("block_size", [4, 16])
def test_teacher_forced_logits_match_transformers(tiny_model, block_size):
    kind, path, hf = tiny_model
    engine = LLMEngine(path, block_size=block_size, num_gpu_blocks=64, dtype="float32")
    rng = random.Random(1)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (40, 23, 33)]
    ours = teacher_forced_logits(engine, prompts, num_prefill=7, block_size=block_size)
    for p, logits in zip(prompts, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]  # (len, vocab)
        assert ref.abs().max() > 1.0  # real-sized logits, not a trivially small comparison
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)


def test_llama_reads_rope_parameters(tmp_path):
    """A non-default RoPE (theta and linear scaling in rope_parameters) is honoured."""
    from tiny_models import save_tiny_model

    hf = save_tiny_model("llama", tmp_path, seed=3, num_attention_heads=4, num_key_value_heads=1,
                         rope_parameters={"rope_type": "linear", "rope_theta": 500.0,
                                          "factor": 2.0})
    engine = LLMEngine(str(tmp_path), block_size=8, num_gpu_blocks=32)
    prompt = list(range(5, 45))
    (ours,) = teacher_forced_logits(engine, [prompt], num_prefill=20, block_size=8)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_tied_embeddings_llama(tmp_path):
    from tiny_models import save_tiny_model

    hf = save_tiny_model("llama", tmp_path, seed=4, tie_word_embeddings=True)
    engine = LLMEngine(str(tmp_path), block_size=16, num_gpu_blocks=16)
    prompt = list(range(3, 30))
    (ours,) = teacher_forced_logits(engine, [prompt], num_prefill=27, block_size=16)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
