"""Lesson 10's pictures show what its text says, and the probe records what the sampler saw.

The lesson's own cells run here on made-up logits (no model) for the distributions, and on a
tiny random LLaMA for the beam-search step."""
import xml.etree.ElementTree as ET

import pytest
import torch
from IPython.display import SVG

from lesson_cells import run_cell
from minipaged import LLM, SamplingParams
from minipaged.lab.sampler_probe import SamplerProbe, beam_candidates, sampler_logprobs
from minipaged.worker.sampler import draw, top_k_top_p_filter
from visualizer.sampling import render_beam_step, render_token_bars
from visualizer.svg import text_width

pytestmark = pytest.mark.lesson10


def _logits_namespace(seed: int = 0) -> dict:
    """What section 1 leaves behind, from made-up logits over 300 tokens."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(300, generator=generator) * 2.5  # (V,)
    probs = torch.softmax(logits, dim=-1)
    top_ids = torch.topk(probs, 12).indices.tolist()
    return dict(torch=torch, SVG=SVG, SamplingParams=SamplingParams, logits=logits, probs=probs,
                top_ids=top_ids, labels=[f"t{t}" for t in top_ids], prompt="made up",
                sampler_logprobs=sampler_logprobs, render_token_bars=render_token_bars,
                top_k_top_p_filter=top_k_top_p_filter, draw=draw)


def _bars(svg) -> dict[str, list[tuple[str, float, bool]]]:
    root = ET.fromstring(svg.data)
    bars: dict[str, list] = {}
    for g in root.iter():
        if g.get("class") == "bar":
            bars.setdefault(g.get("data-series"), []).append(
                (g.get("data-token"), float(g.get("data-p")), g.get("data-dropped") == "1"))
    return bars


def _title_fits(svg) -> None:
    root = ET.fromstring(svg.data)
    title = next(t for t in root.iter() if t.get("class") == "caption")
    assert float(title.get("x")) + text_width(title.text, 13) <= float(root.get("width"))


def _legend_colours_are_distinct(svg) -> None:
    root = ET.fromstring(svg.data)
    fills = [next(e for e in g if e.tag.endswith("rect") or e.tag.endswith("line"))
             for g in root.iter() if g.get("class") == "legend-entry"]
    keys = [(e.get("fill"), e.get("stroke"), e.get("stroke-dasharray")) for e in fills]
    assert len(set(keys)) == len(keys), keys


def test_temperature_picture_sharpens_below_one_and_flattens_above():
    ns = _logits_namespace()
    [svg] = run_cell("10_sampling", "temperatures = [0.5, 1.0, 1.5]", ns)
    bars = _bars(svg)
    assert list(bars) == ["T = 0.5", "T = 1.0", "T = 1.5"]
    top = [bars[name][0][1] for name in bars]
    assert top[0] > top[1] > top[2]  # the favourite gains below 1, loses above
    expected = ns["probs"][ns["top_ids"]].tolist()  # T = 1 is the model's own distribution
    assert [p for _, p, _ in bars["T = 1.0"]] == pytest.approx(expected, rel=1e-4)
    _title_fits(svg)
    _legend_colours_are_distinct(svg)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_top_p_picture_keeps_what_the_text_says(seed):
    ns = _logits_namespace(seed)
    shown = run_cell("10_sampling", "top_k, top_p = 4, 0.3", ns)
    [svg] = shown
    bars = _bars(svg)
    top_k, top_p = ns["top_k"], ns["top_p"]
    kept_k = [not gone for _, _, gone in bars[f"top_k = {top_k}"]]
    assert kept_k == [True] * top_k + [False] * (12 - top_k)
    # top-p: kept while the tokens before reach less than top_p; the crossing token is kept
    probs = [p for _, p, _ in bars[f"top_p = {top_p}"]]
    kept_p = [not gone for _, _, gone in bars[f"top_p = {top_p}"]]
    before = [sum(probs[:i]) for i in range(12)]
    assert kept_p == [i == 0 or b < top_p for i, b in enumerate(before)]
    root = ET.fromstring(svg.data)
    [threshold] = [g for g in root.iter() if g.get("class") == "threshold"]
    assert float(threshold.get("data-value")) == top_p
    assert any(g.get("class") == "cumulative" for g in root.iter())
    _title_fits(svg)
    _legend_colours_are_distinct(svg)

    # 2,000 draws land in the nucleus, in shares close to its probabilities
    del ns["display"]
    [draws] = run_cell("10_sampling", "nucleus = torch.softmax(after_p", ns)
    series = _bars(draws)
    probability, share = series.values()
    assert sum(p for _, p, _ in share[:-1]) == pytest.approx(1.0)
    assert share[-1][1] == 0.0  # the first token outside the nucleus: never drawn
    for (_, p, _), (_, s, _) in zip(probability, share):
        assert abs(p - s) < 0.05
    _title_fits(draws)


def test_beam_step_picture_keeps_the_best_scores_of_all_beams(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, num_cpu_blocks=0)
    probe = SamplerProbe(llm.llm_engine)
    beam = SamplingParams(n=3, best_of=3, use_beam_search=True, temperature=0, max_tokens=6,
                          ignore_eos=True)
    beams = llm.generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=beam,
                         use_tqdm=False)[0]
    probe.detach()
    assert llm.llm_engine.sampler is probe.sampler

    class Tok:
        @staticmethod
        def decode(ids):
            return " ".join(map(str, ids))

    ns = dict(probe=probe, beams=beams, tok=Tok, beam_candidates=beam_candidates,
              render_beam_step=render_beam_step, SVG=SVG)
    [svg] = run_cell("10_sampling", "beam_calls = probe.calls_of", ns)
    root = ET.fromstring(svg.data)
    assert len([g for g in root.iter() if g.get("class") == "beam"]) == 3
    candidates = [(float(g.get("data-score")), g.get("data-kept") == "1")
                  for g in root.iter() if g.get("class") == "candidate"]
    assert len(candidates) == 9
    best = sorted((s for s, _ in candidates), reverse=True)[:3]
    assert sorted((s for s, kept in candidates if kept), reverse=True) == best
    _title_fits(svg)
    # every step the probe recorded continues the beams with the kept candidates' tokens
    final = {tuple(o.token_ids) for o in beams.outputs}
    last = beam_candidates(probe.calls_of(beams.request_id)[-1], beams.request_id, per_beam=3)
    ends = {tuple(b["output_token_ids"]) + (c["token"],) for b in last
            for c in b["candidates"] if c["kept_as"] is not None}
    assert final <= ends


def test_sampler_logprobs_are_the_temperature_scaled_distribution():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3))  # (V,)
    for t in (0.5, 1.0, 2.0):
        got = sampler_logprobs(logits, SamplingParams(temperature=t), num_top=5)
        expected = torch.log_softmax(logits / t, dim=-1)
        top = torch.topk(expected, 5)
        assert list(got) == top.indices.tolist()
        assert list(got.values()) == pytest.approx(top.values.tolist(), abs=1e-5)


def test_token_bars_refuse_nothing_to_draw():
    with pytest.raises(ValueError):
        render_token_bars([], {})
    with pytest.raises(ValueError):
        render_beam_step([])
