"""Lesson 10 as a learner answers it: the lesson's ``apply_penalties`` and ``top_k_top_p_filter``
(imported in its first cell), a temperature helper in a cell of its own, every row's logprobs at
once."""

# %%
def temperature_of(params):
    """Greedy and beam search keep the model's own logprobs: temperature 1."""
    return 1.0 if params.greedy or params.use_beam_search else params.temperature


# %%
class MySampler(Sampler):
    def __call__(self, logits, rows, generators):
        logits = apply_penalties(logits, rows)
        temps = torch.tensor([temperature_of(r.seq_group.sampling_params) for r in rows],
                             device=logits.device)
        logits = logits / temps[:, None]
        logprobs = torch.log_softmax(logits, dim=-1)
        by_request = {}
        for i, row in enumerate(rows):
            by_request.setdefault(row.seq_group.request_id, []).append(i)
        out = {}
        for request_id, idx in by_request.items():
            group = rows[idx[0]].seq_group
            params = group.sampling_params
            if params.use_beam_search:
                picks = self._beam_search(group, [rows[i] for i in idx], logprobs[idx])
            else:
                picks = {}
                for k, i in enumerate(idx):
                    for seq_id in rows[i].seq_ids:
                        if params.greedy:
                            picks[seq_id] = (k, seq_id, int(logits[i].argmax()))
                        else:
                            kept = top_k_top_p_filter(logits[i], params.top_k, params.top_p)
                            token = draw(torch.softmax(kept, dim=-1), generators[seq_id])
                            picks[seq_id] = (k, seq_id, token)
            out[request_id] = {}
            for seq_id, (k, parent, token) in picks.items():
                row_logprobs = logprobs[idx[k]]
                reported = {token: row_logprobs[token].item()}
                if params.logprobs:
                    best = torch.topk(row_logprobs, min(params.logprobs, len(row_logprobs)))
                    for t, v in zip(best.indices.tolist(), best.values.tolist()):
                        reported.setdefault(t, v)
                out[request_id][seq_id] = SequenceOutput(parent, token, reported)
        return out
