"""The step trace (``trace_path``): read back by ``trace_reader`` (written from the
trace-event format's documented fields, never from the writer's code) and checked against the
engine's own stats and the snapshots its observers saw (lesson 15).
"""
from collections import defaultdict

import pytest

from minipaged import LLM, SamplingParams
from trace_reader import read_trace, tracks

PHASES = ("schedule", "prepare", "model", "sample", "update")


@pytest.fixture(scope="module")
def traced_run(tiny_llama, tmp_path_factory):
    """A run that preempts (a tiny pool), with the trace and an observer keeping each snapshot."""
    path = str(tmp_path_factory.mktemp("trace") / "steps.json")
    llm = LLM(tiny_llama[0], block_size=4, num_gpu_blocks=10, watermark=0.0, max_model_len=40,
              max_num_batched_tokens=16, trace_path=path)
    snaps = []
    llm.llm_engine.add_observer(snaps.append)
    prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8, 9, 10 + i] for i in range(4)]
    llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                 sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    read_trace(path, closed=False)  # readable while the engine runs: no "]" yet
    stats = llm.llm_engine.stats
    llm.shutdown()
    return read_trace(path), stats, snaps, [str(i) for i in range(4)]


def test_a_slice_per_step_holding_its_five_phases_whose_times_are_the_stats(traced_run):
    events, stats, snaps, _ = traced_run
    steps, _, _ = tracks(events)
    step_slices = [e for e in steps if e["name"].startswith("step ")]
    assert len(step_slices) == stats.num_steps == len(snaps)
    assert [e["name"] for e in step_slices] == [f"step {s.step}" for s in snaps]
    for name, total in zip(PHASES, (stats.time_schedule, stats.time_prepare, stats.time_model,
                                    stats.time_sample, stats.time_update)):
        slices = [e for e in steps if e["name"] == name]
        assert len(slices) == stats.num_steps
        assert sum(e["dur"] for e in slices) / 1e6 == pytest.approx(total, rel=1e-3, abs=1e-4)
    # each phase lies inside its step, and the phases follow one another
    for i, step in enumerate(step_slices):
        phases = [e for e in steps if e["name"] in PHASES][5 * i:5 * i + 5]
        assert [e["name"] for e in phases] == list(PHASES)
        assert phases[0]["ts"] == step["ts"]
        for a, b in zip(phases, phases[1:]):
            assert b["ts"] == pytest.approx(a["ts"] + a["dur"], abs=0.01)
        end = phases[-1]["ts"] + phases[-1]["dur"]
        assert end == pytest.approx(step["ts"] + step["dur"], abs=0.01)


def test_counters_are_the_pool_the_queues_and_the_batched_tokens(traced_run):
    events, stats, snaps, _ = traced_run
    _, _, counters = tracks(events)
    by_name = defaultdict(list)
    for e in counters:
        by_name[e["name"]].append(e["args"])
    assert len(by_name["batched tokens"]) == stats.num_steps
    assert sum(a["tokens"] for a in by_name["batched tokens"]) == \
        stats.num_prompt_tokens + stats.num_generation_tokens
    blocks = by_name["KV blocks"]
    assert all(a["free"] + a["used"] == 10 for a in blocks)
    assert max(a["used"] for a in blocks) == stats.peak_gpu_blocks_used
    assert blocks[-1] == {"free": 10, "used": 0}  # all given back at the end
    assert [a["running"] for a in by_name["sequences"]] == \
        [len(s.scheduler["running"]) for s in snaps]
    assert [a["waiting"] for a in by_name["sequences"]] == \
        [len(s.scheduler["waiting"]) for s in snaps]


def test_a_track_per_request_waiting_prefill_decode_preempted_finished(traced_run):
    events, stats, snaps, request_ids = traced_run
    _, per_request, _ = tracks(events)
    assert sorted(per_request) == request_ids
    assert stats.num_preemptions_recompute > 0  # the tiny pool did preempt
    preempted = [e for evs in per_request.values() for e in evs if e["name"] == "preempted"]
    assert len(preempted) == stats.num_preemptions_recompute + stats.num_preemptions_swap
    for rid, evs in per_request.items():
        names = [e["name"] for e in evs]
        assert names[0] == "waiting" and names[-1] == "finished" and names.count("finished") == 1
        prefills = sum(rid == r and p for s in snaps for r, p in zip(s.scheduled, s.prompt_run))
        decodes = sum(rid == r and not p for s in snaps for r, p in zip(s.scheduled, s.prompt_run))
        assert names.count("prefill") == prefills
        assert sum(e["args"]["steps"] for e in evs if e["name"] == "decode") == decodes
        assert names.count("preempted (recompute)") == names.count("preempted")
        # the track's slices never overlap: one state at a time
        slices = sorted((e for e in evs if e["ph"] == "X"), key=lambda e: e["ts"])
        for a, b in zip(slices, slices[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 0.01, (a, b)


def test_a_path_that_cannot_be_written_is_refused_by_name(tiny_llama, tmp_path):
    from minipaged.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="trace_path: cannot write"):
        LLMEngine(tiny_llama[0], trace_path=str(tmp_path / "no" / "such" / "dir.json"))
    with pytest.raises(ValueError, match="trace_path must be None or a file path"):
        LLMEngine(tiny_llama[0], trace_path=3)


def test_the_server_closes_the_trace_when_it_stops(tiny_llama, tmp_path):
    """(uvicorn ends the process by the signal it got after a SIGTERM: no atexit runs, so the
    server's shutdown closes the trace)"""
    from minipaged.engine.async_llm_engine import AsyncLLMEngine
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.entrypoints.api_server import BackgroundServer, build_app

    path = tmp_path / "served.json"
    engine = LLMEngine(tiny_llama[0], num_gpu_blocks=20, block_size=4, max_model_len=64,
                       trace_path=str(path))
    with BackgroundServer(build_app(AsyncLLMEngine(engine), "t")) as server:
        import httpx

        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "t", "prompt": [3, 4, 5], "max_tokens": 3})
        assert reply.status_code == 200
    assert engine.trace.closed
    _, per_request, _ = tracks(read_trace(path))  # closed: the "]" is there
    assert [e["name"] for evs in per_request.values() for e in evs][-1] == "finished"
