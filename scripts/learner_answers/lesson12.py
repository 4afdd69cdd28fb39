"""Lesson 12 as a learner answers it: ``rejection_sample`` calls the learner's own
``residual_distribution`` (the exercise of cell 24, answered there), which calls a helper of
another cell; the greedy verification counts the agreed prefix with a helper."""

# %%
def agreed_prefix(target_argmax_ids, draft_token_ids):
    """How many drafts in a row the target's argmax agrees with."""
    n = 0
    while n < len(draft_token_ids) and draft_token_ids[n] == target_argmax_ids[n]:
        n += 1
    return n


# %%
def greedy_verify(target_argmax_ids, draft_token_ids):
    n = agreed_prefix(target_argmax_ids, draft_token_ids)
    return list(draft_token_ids[:n]) + [target_argmax_ids[n]]


# %%
FLOOR = 0.0  # nothing below zero survives


def positive_part(x):
    return torch.clamp(x, min=FLOOR)


# %%
def residual_distribution(p, q):
    r = positive_part(p - q)
    total = r.sum()
    return r / total if total > 0 else p


# %%
def rejection_sample(target_probs, draft_token_ids, draft_probs, generator):
    p_all = target_probs.double()
    out = []
    for i, guess in enumerate(draft_token_ids):
        p = p_all[i]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[guess] = 1.0
        else:
            q = draft_probs[i].double()
        u = torch.rand((), generator=generator, dtype=torch.float64).item()
        if u * q[guess].item() < p[guess].item():
            out.append(guess)
        else:
            out.append(draw(residual_distribution(p, q), generator))
            return out
    out.append(draw(p_all[len(draft_token_ids)], generator))
    return out
