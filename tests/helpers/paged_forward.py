"""A model run by hand on the engine's paged cache: a packed prefill, then one token per step
(``tests/models``: our models' logits against transformers')."""
import random

import torch

from minipaged.models.input_metadata import InputMetadata


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
