"""The step trace (``trace_path``), in both its formats, read back by readers that are not the
writer's and checked against the engine's own stats and the snapshots its observers saw
(lesson 15): the JSON by ``trace_reader`` (written from the trace-event format's documented
fields), Perfetto's protobuf format by ``perfetto_reader`` (the `perfetto` package's own
definitions), and both by Perfetto's trace processor where its binary is on the machine.
"""
import glob
import os
from collections import defaultdict

import pytest

from minipaged import LLM, SamplingParams
from perfetto_reader import perfetto_tracks, read_packets
from trace_reader import read_trace, tracks

PHASES = ("schedule", "prepare", "model", "sample", "update")
COUNTERS = {"KV blocks": ("free", "used"), "sequences": ("running", "waiting", "swapped"),
            "batched tokens": ("tokens",)}


def read_back(path: str):
    """(the steps' slices, each request's events, counter name -> its args at each step), from
    either format."""
    if path.endswith(".json"):
        steps, per_request, counters = tracks(read_trace(path))
        by_name = defaultdict(list)
        for e in counters:
            by_name[e["name"]].append(e["args"])
        return steps, per_request, by_name
    steps, per_request, series = perfetto_tracks(path)
    by_name = {}  # a counter track per series ("KV blocks free"), joined back per step
    for name, keys in COUNTERS.items():
        columns = [series[name if len(keys) == 1 else f"{name} {key}"] for key in keys]
        by_name[name] = [dict(zip(keys, row)) for row in zip(*columns)]
    return steps, per_request, by_name


@pytest.fixture(scope="module", params=["steps.json", "steps.perfetto-trace"])
def traced_run(request, tiny_llama, tmp_path_factory):
    """A run that preempts (a tiny pool), with the trace and an observer keeping each snapshot."""
    path = str(tmp_path_factory.mktemp("trace") / request.param)
    llm = LLM(tiny_llama[0], block_size=4, num_gpu_blocks=10, watermark=0.0, max_model_len=40,
              max_num_batched_tokens=16, trace_path=path)
    snaps = []
    llm.llm_engine.add_observer(snaps.append)
    prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8, 9, 10 + i] for i in range(4)]
    llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                 sampling_params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    if path.endswith(".json"):
        read_trace(path, closed=False)  # readable while the engine runs: no "]" yet
    else:
        read_packets(path)  # a whole trace after any step: nothing to close
    stats = llm.llm_engine.stats
    llm.shutdown()
    return read_back(path), stats, snaps, [str(i) for i in range(4)], path


def test_a_slice_per_step_holding_its_five_phases_whose_times_are_the_stats(traced_run):
    (steps, _, _), stats, snaps, _, _ = traced_run
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
    (_, _, by_name), stats, snaps, _, _ = traced_run
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
    (_, per_request, _), stats, snaps, request_ids, _ = traced_run
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


def trace_processor_binary() -> str | None:
    """``$MINIPAGED_TRACE_PROCESSOR``, else the binary the `perfetto` package keeps after its
    first download (~/.local/share/perfetto/prebuilts), else None."""
    path = os.environ.get("MINIPAGED_TRACE_PROCESSOR")
    if path:
        return path
    found = [p for p in glob.glob(os.path.expanduser(
        "~/.local/share/perfetto/prebuilts/trace_processor_shell*")) if not p.endswith(".tmp")]
    return found[0] if found else None


def test_perfettos_trace_processor_counts_the_steps_slices_and_counters(traced_run):
    binary = trace_processor_binary()
    if binary is None:
        pytest.skip("Perfetto's trace processor binary is not on this machine (the perfetto "
                    "package downloads it on first use; set MINIPAGED_TRACE_PROCESSOR to a "
                    "trace_processor_shell): the trace was read with the package's protobuf "
                    "definitions instead")
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    _, stats, snaps, request_ids, path = traced_run
    tp = TraceProcessor(trace=path, config=TraceProcessorConfig(bin_path=binary))
    try:
        names = {row.name: row.n for row in tp.query(
            "select name, count(*) as n from slice group by name")}
        counters = {row.name: row.n for row in tp.query(
            "select t.name as name, count(*) as n from counter c "
            "join counter_track t on c.track_id = t.id group by t.name")}
    finally:
        tp.close()
    assert sum(n for name, n in names.items() if name.startswith("step ")) == stats.num_steps
    assert all(names[phase] == stats.num_steps for phase in PHASES)
    assert names["finished"] == len(request_ids)
    assert names["preempted"] == stats.num_preemptions_recompute + stats.num_preemptions_swap
    # (a JSON counter's tracks are named by the processor after its name and each arg's key)
    batched = next(n for name, n in counters.items() if name.startswith("batched tokens"))
    assert batched == stats.num_steps == len(snaps)
