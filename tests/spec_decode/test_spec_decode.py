"""Speculative decoding in the engine (lesson 12): exact where it must be, paged all the way.

Greedy outputs with speculation (n-gram prompt lookup, a small draft model, the target as its own
draft) are token for token, and logprob for logprob, those without it, under preemption by
recompute and by swap, prefix caching, chunked prefill with a tiny budget, n > 1, penalties, EOS
and max_tokens; seeded sampling is the same in any batch; bad configurations are refused before
anything is queued; the stats, the snapshot and /metrics show what was proposed and kept.

Slow (left out of `make test`): the exactness grid over both models and all three proposers, the
snapshot test and the backoff test, about 170 s together on the 2-core machine (measured at load
~15), and the embedded-model test.
"""
from __future__ import annotations

import json
import types

import pytest

from minipaged import LLM, LLMEngine, SamplingParams
from tiny_models import config_with_eos, save_tiny_model

pytestmark = pytest.mark.lesson12

# Prompts that repeat themselves, so that prompt lookup finds matches.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [10, 11, 12, 13, 10, 11],
           [3] * 11, [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 40, 41, 42], [77]]
LOGPROB_TOL = 1e-4
MAX_DIFF = {"seen": 0.0}  # the largest logprob difference any comparison saw (printed with -s)


def requests(eos_stop: bool = False) -> list[SamplingParams]:
    common = dict(temperature=0.0, ignore_eos=not eos_stop, logprobs=2)
    return [SamplingParams(max_tokens=30, **common),
            SamplingParams(max_tokens=13, n=2, **common),
            SamplingParams(max_tokens=1, **common),
            SamplingParams(max_tokens=17, presence_penalty=0.5, frequency_penalty=0.3, **common),
            SamplingParams(max_tokens=22, **common)]


def run(engine: LLMEngine, params: list[SamplingParams], prompts=PROMPTS) -> dict:
    """Every request to completion; {request id: [(tokens, logprobs, finish reason), ...]}."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), None, p, prompt_token_ids=prompt)
    done = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.logprobs, c.finish_reason)
                                        for c in out.outputs]
    bm = engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks  # nothing leaked
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    return done


def assert_same(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for rid in expected:
        for (tokens_a, lps_a, reason_a), (tokens_b, lps_b, reason_b) in zip(expected[rid],
                                                                            got[rid]):
            assert tokens_a == tokens_b, f"request {rid}"
            assert reason_a == reason_b
            for a, b in zip(lps_a, lps_b):
                assert a.keys() == b.keys()
                for t in a:
                    diff = abs(a[t] - b[t])
                    MAX_DIFF["seen"] = max(MAX_DIFF["seen"], diff)
                    assert diff < LOGPROB_TOL, (rid, t, a[t], b[t])


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """A one-layer draft of each architecture, the tiny models' vocabulary."""
    out = {}
    for kind in ("llama", "gpt2"):
        path = tmp_path_factory.mktemp(f"draft_{kind}")
        layers = {"num_hidden_layers": 1} if kind == "llama" else {"n_layer": 1}
        save_tiny_model(kind, path, seed=1, **layers)
        out[kind] = str(path)
    return out


ENGINES = {  # engine settings: each forces a path the verification must survive
    "roomy": dict(block_size=4, num_gpu_blocks=256),
    "recompute": dict(block_size=4, num_gpu_blocks=24, preemption_mode="recompute",
                      max_model_len=64),
    "swap": dict(block_size=4, num_gpu_blocks=24, num_cpu_blocks=64, preemption_mode="swap",
                 max_model_len=64),
    "budget": dict(block_size=8, num_gpu_blocks=128, max_num_batched_tokens=5,
                   enable_prefix_caching=False),
}


_BASELINES: dict = {}


def baseline(path: str, name: str) -> tuple[dict, LLMEngine]:
    """The outputs without speculation, once per model and engine settings."""
    if (path, name) not in _BASELINES:
        engine = LLMEngine(path, dtype="float32", **ENGINES[name])
        _BASELINES[path, name] = run(engine, requests()), engine
    return _BASELINES[path, name]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft", "self"])
def test_greedy_with_speculation_is_exactly_greedy(tiny_model, drafts, method):
    kind, path, _ = tiny_model
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
            "draft": {"model": drafts[kind], "num_speculative_tokens": 3},
            "self": {"model": path, "num_speculative_tokens": 4}}[method]
    for name, settings in ENGINES.items():
        if method == "self" and name != "roomy":
            continue  # (the target as draft is slow: once is enough)
        expected, base_engine = baseline(path, name)
        engine = LLMEngine(path, dtype="float32", speculative_config=spec, **settings)
        got = run(engine, requests())
        assert_same(expected, got)
        stats = engine.stats
        assert stats.num_spec_proposed_tokens > 0, name
        if name in ("recompute", "swap"):
            assert stats.num_preemptions_recompute + stats.num_preemptions_swap > 0, name
        assert stats.num_spec_emitted_tokens == (stats.num_spec_accepted_tokens
                                                 + stats.num_spec_verifications)
    print(f"max logprob difference seen: {MAX_DIFF['seen']:.2e}")


def test_the_target_as_its_own_draft_accepts_every_proposal(tiny_llama):
    """(Without penalties: the draft proposes without them, the target verifies with them.)"""
    path, _ = tiny_llama
    engine = LLMEngine(path, dtype="float32", block_size=4,
                       speculative_config={"model": path, "num_speculative_tokens": 4})
    params = [p for p in requests() if not p.presence_penalty]
    run(engine, params, [p for p, q in zip(PROMPTS, requests()) if not q.presence_penalty])
    stats = engine.stats
    assert stats.num_spec_accepted_tokens == stats.num_spec_proposed_tokens > 0
    assert stats.spec_acceptance_rate == 1.0


def test_eos_inside_the_accepted_drafts_ends_the_sequence_there(tiny_llama):
    path, _ = tiny_llama
    plain = run(LLMEngine(path, dtype="float32", block_size=4), requests())
    eos = plain["0"][0][0][7]  # a token the first request generates: as EOS it stops it there
    config = config_with_eos(path, eos)
    expected = run(LLMEngine(path, dtype="float32", block_size=4, hf_config=config),
                   requests(eos_stop=True))
    got = run(LLMEngine(path, dtype="float32", block_size=4, hf_config=config,
                        speculative_config={"model": path, "num_speculative_tokens": 5}),
              requests(eos_stop=True))
    assert_same(expected, got)
    assert expected["0"][0][2] == "stop"


def test_seeded_sampling_is_the_same_in_any_batch(tiny_llama, drafts):
    path, _ = tiny_llama
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=1234, max_tokens=30, ignore_eos=True)
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"model": drafts["llama"], "num_speculative_tokens": 2}):
        alone = run(LLMEngine(path, dtype="float32", block_size=4, speculative_config=spec),
                    [seeded], [PROMPTS[0]])
        others = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 3
        crowded = run(LLMEngine(path, dtype="float32", block_size=4, num_gpu_blocks=30,
                                max_model_len=64, speculative_config=spec),
                      others[:2] + [seeded] + others[2:], PROMPTS[1:3] + PROMPTS[:1] + [[9]])
        assert alone["0"][0][0] == crowded["2"][0][0]


@pytest.mark.parametrize("spec,field", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
    ({"model": "/nonexistent/draft", "num_speculative_tokens": 2}, "speculative_config.model"),
    ("ngram", "speculative_config"),
])
def test_bad_configs_are_refused_naming_the_field(tiny_llama, spec, field):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match=field):
        LLM(path, speculative_config=spec)


def test_a_draft_with_another_vocabulary_and_beam_search_are_refused(tiny_llama, tmp_path):
    path, _ = tiny_llama
    save_tiny_model("gpt2", tmp_path, vocab_size=128)
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary"):
        LLMEngine(path, speculative_config={"model": str(tmp_path),
                                            "num_speculative_tokens": 2})
    engine = LLMEngine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="use_beam_search"):
        engine.add_request("b", None, SamplingParams(use_beam_search=True, best_of=2,
                                                     temperature=0.0), prompt_token_ids=[1, 2])
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_snapshot_rollback_events_stats_and_metrics(tiny_llama, drafts):
    from minipaged.engine.async_llm_engine import AsyncLLMEngine
    from minipaged.entrypoints.metrics import prometheus_text

    path, _ = tiny_llama
    engine = LLMEngine(path, dtype="float32", block_size=4,
                       speculative_config={"model": drafts["llama"], "num_speculative_tokens": 4})
    snaps, events = [], []
    engine.add_observer(snaps.append)
    engine.block_manager.add_listener(events.append)
    run(engine, requests()[:1], PROMPTS[:1])
    verified = [s.spec for s in snaps if s.spec]
    assert verified
    for spec in verified:
        for info in spec.values():
            assert 0 <= info["accepted"] <= len(info["proposed"]) <= 4
            assert len(info["emitted"]) == info["accepted"] + 1
            assert len(info["lookahead_slots"]) == len(info["proposed"])
            assert len(info["blocks_after"]) <= len(info["blocks_before"])
    assert any(e["op"] == "rollback" for e in events)
    assert any(e["op"] == "lookahead" for e in events)
    from visualizer.events import describe
    for e in events:
        if e["op"] in ("lookahead", "rollback"):
            assert describe(e, engine.block_manager.snapshot()).startswith("seq ")
    stats = engine.stats.as_dict()
    assert stats["spec_acceptance_rate"] == pytest.approx(
        stats["num_spec_accepted_tokens"] / stats["num_spec_proposed_tokens"])
    assert 1.0 <= stats["spec_mean_accepted_length"] <= 5.0
    fake = types.SimpleNamespace(engine=engine, num_requests_finished={}, error=None,
                                 is_running=True)
    AsyncLLMEngine._publish_metrics(fake)
    text = prometheus_text(fake)
    assert f"minipaged_spec_proposed_tokens_total {stats['num_spec_proposed_tokens']}" in text
    assert "minipaged_spec_acceptance_rate " in text
    assert "minipaged_spec_mean_accepted_length " in text


def test_cli_flags_reach_the_engine(monkeypatch, tiny_llama):
    import minipaged.entrypoints.api_server
    from minipaged.entrypoints import cli

    path, _ = tiny_llama
    served = {}
    monkeypatch.setattr(minipaged.entrypoints.api_server, "serve",
                        lambda async_engine, name, *a: served.update(engine=async_engine.engine))
    argv = ["serve", path, "--speculative-config",
            json.dumps({"method": "ngram", "num_speculative_tokens": 4}),
            "--prompt-lookup-max", "2", "--num-speculative-tokens", "3"]
    assert cli.main(argv) == 0
    config = served["engine"].config.speculative_config
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_max) == \
        ("ngram", 3, 2)
    args = cli.main.__globals__["argparse"].Namespace(
        speculative_config=None, speculative_method=None, speculative_model=path,
        num_speculative_tokens=2, prompt_lookup_max=None, prompt_lookup_min=None)
    assert cli.speculative_config(args) == {"model": path, "num_speculative_tokens": 2}
    assert cli.main(["serve", path, "--num-speculative-tokens", "0",
                     "--speculative-method", "ngram"]) == 2


@pytest.mark.slow
def test_embedded_model_greedy_with_prompt_lookup_and_a_stop_string():
    prompt = ("Repeat this list exactly: apples, pears, plums, cherries, grapes, figs, dates, "
              "kiwis, melons, limes, lemons. Again: apples,")
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=1, stop=["lemons"])
    base = LLM(None, block_size=16)
    expected = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    llm = LLM(None, block_size=16, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert got.finish_reason == expected.finish_reason
    for a, b in zip(expected.logprobs, got.logprobs):
        for t in a:
            MAX_DIFF["seen"] = max(MAX_DIFF["seen"], abs(a[t] - b[t]))
            assert abs(a[t] - b[t]) < LOGPROB_TOL
    assert llm.llm_engine.stats.num_spec_accepted_tokens > 0
    print(f"embedded: {len(got.token_ids)} tokens, finish {got.finish_reason}, "
          f"acceptance {llm.llm_engine.stats.spec_acceptance_rate:.2f}, "
          f"max logprob difference seen: {MAX_DIFF['seen']:.2e}")


@pytest.mark.slow
def test_a_sequence_whose_guesses_are_rejected_stops_guessing_for_a_while(tiny_llama, drafts):
    """The backoff (spec_decode/speculator.py): a draft that is mostly wrong (here, a random
    one-layer model) is asked less and less, and the output is still exactly greedy."""
    from minipaged.spec_decode import speculator

    path, _ = tiny_llama
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, logprobs=2)]
    prompt = [[5, 6, 7, 8, 9, 5, 6, 7]]
    plain = run(LLMEngine(path, dtype="float32", block_size=4), params, prompt)
    engine = LLMEngine(path, dtype="float32", block_size=4, speculative_config={
        "model": drafts["llama"], "num_speculative_tokens": 4})
    assert_same(plain, run(engine, params, prompt))
    stats = engine.stats
    assert stats.spec_acceptance_rate < speculator.MIN_ACCEPTANCE  # the draft is poor
    # Without the backoff every decode step of this one sequence would be a verification.
    decode_steps = stats.num_steps - 1
    assert stats.num_spec_verifications < decode_steps / 2, (stats.num_spec_verifications,
                                                             decode_steps)
