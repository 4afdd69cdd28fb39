"""From logits to next tokens: penalties, temperature, top-k, top-p, greedy, beam search (lesson 10).

The sampler sees one row of logits per *row* of the step (see ``model_runner.Row``). A fresh
group's sequences share one prompt row, and draw ``best_of`` tokens from it. For beam search the
candidates of all beams of a group compete, and each surviving candidate names its parent beam.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from minipaged.worker.model_runner import Row
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import SequenceGroup


@dataclass
class SequenceOutput:
    parent_seq_id: int  # the sequence this token continues (another beam for beam search)
    token_id: int
    logprobs: dict[int, float]  # the chosen token's logprob, plus the top-k asked for


def apply_penalties(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Presence and frequency penalties over each row's *generated* tokens (not the prompt)."""
    pres = [r.seq_group.sampling_params.presence_penalty for r in rows]
    freq = [r.seq_group.sampling_params.frequency_penalty for r in rows]
    if not any(pres) and not any(freq):
        return logits
    num_rows, vocab = logits.shape
    counts = torch.zeros(num_rows, vocab, device=logits.device)  # (R, V)
    for i, row in enumerate(rows):
        output = row.seq_group.find(row.seq_ids[0]).output_token_ids
        if output:
            ids = torch.tensor(output, device=logits.device)
            counts[i].index_add_(0, ids, torch.ones(len(output), device=logits.device))
    pres_t = torch.tensor(pres, device=logits.device)[:, None]  # (R, 1)
    freq_t = torch.tensor(freq, device=logits.device)[:, None]  # (R, 1)
    return penalize(logits, counts, pres_t, freq_t)


def penalize(logits: torch.Tensor, counts: torch.Tensor, presence, frequency) -> torch.Tensor:
    """``logits`` less ``frequency`` per earlier occurrence (``counts``, same shape) and less
    ``presence`` once for any (numbers, or (R, 1) tensors: one per row)."""
    return logits - frequency * counts - presence * (counts > 0).float()


def top_k_top_p_filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits of tokens outside the top-k / nucleus of one row (V,) to -inf."""
    if top_k != -1 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens *before* it already reach top_p (the top one always stays).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop_sorted[0] = False  # (a top_p below float32's range compares as 0)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` (V,), using exactly one random number of ``generator``.

    NOTE: one uniform number per draw, whatever the distribution, is what makes a seeded
    sequence's tokens the same in any batch, after any preemption: its generator advances by one
    per token it samples and by nothing else.
    """
    cdf = torch.cumsum(probs.double(), dim=0)  # (V,)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    token = int(torch.searchsorted(cdf, u, right=True).clamp_(max=len(cdf) - 1))
    while probs[token] <= 0:  # only rounding at the very top can land here
        token -= 1
    return token


def sequence_generators(request_seed: int | str, seq_ids: list[int]) -> dict[int, torch.Generator]:
    """One generator per sequence of a request, seeded from the request's seed and the
    sequence's index: its draws do not depend on the other sequences, the batch or preemption.

    Args:
        request_seed: the request's ``seed``, or a string naming the engine's seed and the
            request id when it brings none.
        seq_ids: the request's sequences, in order (index 0, 1, ...).
    """
    generators = {}
    for index, seq_id in enumerate(seq_ids):
        # NOTE: a hash, not Python's hash(): the same 64-bit seed in every process.
        digest = hashlib.sha256(f"{request_seed}/{index}".encode()).digest()
        generator = torch.Generator(device="cpu")
        generator.manual_seed(int.from_bytes(digest[:8], "little"))
        generators[seq_id] = generator
    return generators


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[Row],
                 generators: dict[int, torch.Generator]) -> dict[str, dict[int, SequenceOutput]]:
        """Returns, per request id, the next token of each of its sequences in this step.

        ``generators`` holds one random generator per sequence id (see ``draw``).
        """
        logits = apply_penalties(logits, rows)  # (R, V)
        params = [r.seq_group.sampling_params for r in rows]
        # NOTE: as in vLLM v0.1, returned logprobs are those of the distribution after penalties
        # and temperature (temperature 1 for greedy and beam search), before top-k/top-p.
        temps = [1.0 if p.greedy or p.use_beam_search else p.temperature for p in params]
        if any(t != 1.0 for t in temps):  # (a batch at temperature 1 divides nothing)
            logits = logits / torch.tensor(temps, device=logits.device)[:, None]
        # log_softmax(logits) = logits - logsumexp(logits): one number per row; the (R, V)
        # logprobs are formed only for the rows that read them whole (beam search).
        lse = torch.logsumexp(logits, dim=-1)  # (R,)

        by_group: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            by_group.setdefault(row.seq_group.request_id, []).append(i)

        # Greedy rows of every group at once: the argmax and its logprob, one transfer to the
        # host for the whole batch (on a GPU each transfer waits for the GPU).
        greedy = [i for i, p in enumerate(params) if p.greedy]
        greedy_choice: dict[int, tuple[int, float]] = {}  # row -> (token, its logprob)
        if greedy:
            every_row = len(greedy) == len(rows)  # the common case: no copy of the logits
            g_logits = logits if every_row else logits[greedy]  # (G, V)
            # the largest logit and its token (the first of equals, as argmax) in one pass
            g_max, g_tokens = torch.max(g_logits, dim=-1)  # (G,), (G,)
            g_lps = g_max - (lse if every_row else lse[greedy])  # the chosen tokens' logprobs
            tokens, lps = torch.stack([g_tokens.double(), g_lps.double()]).tolist()
            greedy_choice = {i: (int(t), lp) for i, t, lp in zip(greedy, tokens, lps)}
        # Random rows move to the host together, where each request's own generator draws.
        random_rows = [i for i, p in enumerate(params)
                       if not p.greedy and not p.use_beam_search]
        host_logits = logits[random_rows].cpu() if random_rows else None  # (random rows, V)
        host_lse = lse[random_rows].cpu().tolist() if random_rows else None
        host_pos = {row: k for k, row in enumerate(random_rows)}

        # (request id, seq id, global row, parent seq id, token) for every sequence, and the
        # chosen token's logprob where the host has it already
        chosen: list[tuple[str, int, int, int, int]] = []
        chosen_lp: list[float | None] = []
        for request_id, idx in by_group.items():
            seq_group = rows[idx[0]].seq_group
            group_params = seq_group.sampling_params
            group_rows = [rows[i] for i in idx]
            if group_params.use_beam_search:
                choices = self._beam_search(seq_group, group_rows,
                                            logits[idx] - lse[idx, None])  # (beams, V)
            elif group_params.greedy:
                choices = {seq_id: (k, seq_id, greedy_choice[i][0])
                           for k, i in enumerate(idx) for seq_id in rows[i].seq_ids}
            else:
                choices = self._random(group_rows, host_logits[[host_pos[i] for i in idx]],
                                       group_params, generators)
            for seq_id, (k, parent, token) in choices.items():
                row = idx[k]
                chosen.append((request_id, seq_id, row, parent, token))
                if group_params.greedy:
                    chosen_lp.append(greedy_choice[row][1])
                elif not group_params.use_beam_search:
                    chosen_lp.append(float(host_logits[host_pos[row], token])
                                     - host_lse[host_pos[row]])
                else:
                    chosen_lp.append(None)  # gathered below

        beam = [j for j, lp in enumerate(chosen_lp) if lp is None]
        if beam:  # the chosen tokens' logprobs of the beam rows, in one gather
            row_idx = torch.tensor([chosen[j][2] for j in beam], device=logits.device)
            token_idx = torch.tensor([chosen[j][4] for j in beam], device=logits.device)
            for j, lp in zip(beam, (logits[row_idx, token_idx] - lse[row_idx]).tolist()):
                chosen_lp[j] = lp
        # The top-k logprobs, where asked, in one topk.
        num_top = [min(rows[c[2]].seq_group.sampling_params.logprobs or 0, logits.shape[-1])
                   for c in chosen]
        top_ids = top_lps = None
        if max(num_top, default=0) > 0:
            row_idx = torch.tensor([c[2] for c in chosen], device=logits.device)
            top = torch.topk(logits[row_idx], max(num_top), dim=-1)
            top_ids, top_lps = top.indices.tolist(), (top.values - lse[row_idx, None]).tolist()

        results: dict[str, dict[int, SequenceOutput]] = {r: {} for r in by_group}
        for j, (request_id, seq_id, _, parent, token) in enumerate(chosen):
            lp = {token: chosen_lp[j]}
            for t, v in zip(top_ids[j][:num_top[j]] if top_ids else [],
                            top_lps[j][:num_top[j]] if top_lps else []):
                lp.setdefault(t, v)
            results[request_id][seq_id] = SequenceOutput(parent, token, lp)
        return results

    # Each strategy returns {seq_id: (row position within the group, parent seq id, token)}.
    @staticmethod
    def _random(rows: list[Row], logits: torch.Tensor, params: SamplingParams,
                generators: dict[int, torch.Generator]) -> dict:
        """``logits`` are on the host, where each sequence's own generator draws."""
        choices = {}
        for i, row in enumerate(rows):
            filtered = top_k_top_p_filter(logits[i], params.top_k, params.top_p)
            probs = torch.softmax(filtered, dim=-1)  # (V,)
            # A shared prompt row draws one token per sequence, each from its own generator.
            for seq_id in row.seq_ids:
                choices[seq_id] = (i, seq_id, draw(probs, generators[seq_id]))
        return choices

    @staticmethod
    def _beam_search(seq_group: SequenceGroup, rows: list[Row], logprobs: torch.Tensor) -> dict:
        """Keep the best continuations of all beams together, by cumulative logprob.

        Args:
            seq_group: the beam-search group (its sequences' cumulative logprobs score the
                candidates).
            rows: the group's rows of the step: one shared prompt row on the first step, then
                one row per live beam.
            logprobs: (len(rows), V) the next-token logprobs of those rows.

        Returns ``{seq_id: (k, parent_seq_id, token_id)}`` for every sequence of the group:
        ``k`` is the position in ``rows`` (and ``logprobs``) the token was chosen from, and the
        token continues sequence ``parent_seq_id`` (the sequence itself, or another beam it
        will be re-forked from).
        """
        seq_ids = [seq_id for row in rows for seq_id in row.seq_ids]
        width = len(seq_ids)  # live beams of this group
        if len(rows) == 1 and len(rows[0].seq_ids) > 1:
            # First step: every beam is the same prompt, so take the top `width` tokens of it.
            top = torch.topk(logprobs[0], width)
            candidates = [(0, t) for t in top.indices.tolist()]
        else:
            cum = torch.tensor([seq_group.find(r.seq_ids[0]).cumulative_logprob for r in rows],
                               device=logprobs.device, dtype=logprobs.dtype)
            scores = (cum[:, None] + logprobs).flatten()  # (beams * V,)
            top = torch.topk(scores, width).indices.tolist()
            vocab = logprobs.shape[-1]
            candidates = [(i // vocab, i % vocab) for i in top]
        # A beam that is a parent of some candidate keeps its own sequence; sequences whose beam
        # was dropped are reused for the other candidates (the engine re-forks them).
        choices: dict[int, tuple[int, int, int]] = {}
        leftovers = []
        for row_pos, token in candidates:
            parent = rows[row_pos].seq_ids[0]
            if len(rows[row_pos].seq_ids) == 1 and parent not in choices:
                choices[parent] = (row_pos, parent, token)
            else:
                leftovers.append((row_pos, parent, token))
        free_ids = [s for s in seq_ids if s not in choices]
        for seq_id, (row_pos, parent, token) in zip(free_ids, leftovers):
            if len(rows[row_pos].seq_ids) > 1:
                parent = seq_id  # first step: all beams are still identical copies
            choices[seq_id] = (row_pos, parent, token)
        return choices
