"""A model run by hand on the engine's paged cache: a packed prefill, then one token per step
(``tests/models``: our models' logits against transformers')."""
import random
from dataclasses import replace

import torch

from minipaged.model_shape import kv_groups
from minipaged.models.input_metadata import InputMetadata


def prefill_meta(lengths, slots):
    return InputMetadata(list(lengths), torch.tensor(slots, dtype=torch.long),
                         torch.zeros(0, 0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 0)


@torch.no_grad()
def teacher_forced_logits(engine, prompts, num_prefill, block_size, seed=0):
    """Prefill the first ``num_prefill`` tokens of every prompt in one packed batch, then feed the
    rest one token per step, all sequences decoding together. Each sequence's blocks are a
    shuffled, non-contiguous set of physical blocks (one table per KV cache group when the
    engine's cache has groups: lesson 20). Returns logits (len, vocab) per prompt."""
    rng = random.Random(seed)
    cache = engine.worker.cache_engine
    caches = cache.gpu_cache
    num_groups = (1 if getattr(cache, "layer_places", None) is None
                  else len(kv_groups(engine.model_shape.windows)))
    free = list(range(engine.worker.cache_engine.num_gpu_blocks))
    rng.shuffle(free)
    tables = [[] for _ in range(num_groups)]  # per group, per prompt
    for p in prompts:
        n = -(-len(p) // block_size)
        for group in tables:
            group.append([free.pop() for _ in range(n)])

    def slot(g, i, pos):
        return tables[g][i][pos // block_size] * block_size + pos % block_size

    def with_groups(meta, slots_of, tables_of):
        """The meta of group 0, with the other groups' slots and tables."""
        meta.group_metas = [replace(meta, slot_mapping=slots_of(g), block_tables=tables_of(g))
                            for g in range(1, num_groups)] or None
        return meta

    model = engine.worker.model
    ids, pos = [], []
    for i, p in enumerate(prompts):
        ids += p[:num_prefill]
        pos += range(num_prefill)

    def prefill_slots(g):
        return torch.tensor([slot(g, i, t) for i in range(len(prompts))
                             for t in range(num_prefill)], dtype=torch.long)

    meta = with_groups(prefill_meta([num_prefill] * len(prompts), prefill_slots(0).tolist()),
                       prefill_slots, lambda g: torch.zeros(0, 0, dtype=torch.int32))
    hidden = model(torch.tensor(ids), torch.tensor(pos), caches, meta)
    logits = model.compute_logits(hidden).view(len(prompts), num_prefill, -1)
    out = [[logits[i, t] for t in range(num_prefill)] for i in range(len(prompts))]
    for t in range(num_prefill, max(len(p) for p in prompts)):
        active = [i for i, p in enumerate(prompts) if t < len(p)]
        max_blocks = max(len(tables[0][i]) for i in active)

        def decode_slots(g):
            return torch.tensor([slot(g, i, t) for i in active])

        def decode_tables(g):
            return torch.tensor([tables[g][i] + [0] * (max_blocks - len(tables[g][i]))
                                 for i in active], dtype=torch.int32)

        meta = with_groups(InputMetadata(
            [], decode_slots(0), decode_tables(0),
            torch.tensor([t + 1] * len(active), dtype=torch.int32), t + 1),
            decode_slots, decode_tables)
        hidden = model(torch.tensor([prompts[i][t] for i in active]),
                       torch.tensor([t] * len(active)), caches, meta)
        logits = model.compute_logits(hidden)
        for row, i in enumerate(active):
            out[i].append(logits[row])
    return [torch.stack(o) for o in out]
