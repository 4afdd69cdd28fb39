"""Lesson 13 exercises: what a streaming server sends, and reading its /metrics.

    stream_delta(sent, text, finished, stop_strings) -> str
        the new text to send in the next server-sent event: ``text`` is the whole output so far
        (the engine's ``CompletionOutput.text``), ``sent`` what the client already has. While
        the output runs, the last ``len(longest stop string) - 1`` characters are held back (they
        may be the start of a stop string the engine will cut off); once it has finished,
        everything left is sent.
    metric_value(metrics_text, name) -> float | None
        the value of the sample ``name`` (with its labels, as written, e.g.
        ``minipaged_requests_finished_total{finish_reason="abort"}``) in a Prometheus text
        exposition, or None if it has no such sample

Expected answers: the server's own ``TextStreamer`` fed the outputs of random generations that
stop on a stop string or at their length; the numbers given to the server's real
``prometheus_text`` (``GET /metrics``) for a stand-in engine with random counters.
"""
from __future__ import annotations

from types import SimpleNamespace

from minipaged.engine.async_llm_engine import TextStreamer
from minipaged.exercises import checking
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for

_ALPHABET = "ab \n."


def _random_generation(rng):
    """(stop strings, [(text so far, finish_reason)] one per step) of a generation that stops
    on a stop string (which the engine cuts off) or at its length, as ``LLMEngine`` does."""
    stops = rng.choice([[], ["\n"], ["ab"], ["."], ["a.b", "\n\n"], ["abba"], ["b b", "ba."]])
    target = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 40)))
    steps, end = [], 0
    while end < len(target):
        previous = end
        end = min(len(target), end + rng.randint(1, 4))  # one token: 1 to 4 characters
        text = target[:end]
        start = max(0, previous - max((len(s) for s in stops), default=1) + 1)
        hits = [i for s in stops if (i := text.find(s, start)) != -1]
        if hits:
            steps.append((text[:min(hits)], "stop"))
            return stops, steps
        steps.append((text, "length" if end == len(target) else None))
    return stops, steps


@exercise
def check_stream_delta(fn, num_cases: int = 300, seed: int | None = 0) -> CheckResult:
    learner = Learner("stream_delta", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        stops, steps = _random_generation(rng)
        streamer = TextStreamer(stops)
        sent = ""
        for k, (text, reason) in enumerate(steps):
            completion = SimpleNamespace(text=text, token_ids=list(range(k + 1)), logprobs=None,
                                         finish_reason=reason)
            expected, _, _ = streamer.update(completion)
            finished = reason is not None
            got = learner(sent, text, finished, list(stops))
            if got != expected:
                longest = max((len(s) for s in stops), default=0)
                if finished:
                    hint = ("the output has finished: nothing can be cut any more, so send "
                            "everything the client does not have yet")
                elif not stops:
                    hint = "without stop strings nothing is held back: send all the new text"
                elif isinstance(got, str) and len(sent + got) > len(streamer.text):
                    hint = (f"hold back the last {longest - 1} characters (the longest stop "
                            f"string, {longest} characters, less one): they may be the start of "
                            f"a stop string, and text already sent cannot be taken back")
                else:
                    hint = (f"hold back only len(longest stop string) - 1 = {longest - 1} "
                            f"characters: a stop string found whole ends the output at once, so "
                            f"more than that can never turn out to be part of one")
                fail(learner.name, case, f"sent={sent!r}, text={text!r}, finished={finished}, "
                     f"stop_strings={stops!r}", got, expected, hint)
            sent += got
    return passed(learner, num_cases)


def _stand_in_engine(rng):
    """What ``prometheus_text`` reads from an ``AsyncLLMEngine``: its metrics and its health."""
    reasons = rng.sample(["abort", "length", "stop"], rng.randint(0, 3))
    metrics = {key: rng.randint(0, 500) for key in (
        "num_requests_running", "num_requests_waiting", "num_requests_swapped",
        "gpu_blocks_used", "gpu_blocks_total", "cpu_blocks_used", "cpu_blocks_total",
        "num_steps", "prompt_tokens", "generation_tokens", "preemptions_recompute",
        "preemptions_swap")}
    metrics["requests_finished"] = {r: rng.randint(0, 50) for r in reasons}
    return SimpleNamespace(metrics=metrics, error=None, is_running=rng.random() < 0.8)


def _questions(engine) -> list[tuple[str, float | None]]:
    """Sample names and the numbers the stand-in engine gave them (None: no such sample)."""
    m = engine.metrics
    finished = m["requests_finished"]
    return [
        ("minipaged_gpu_blocks_used", m["gpu_blocks_used"]),
        ("minipaged_gpu_blocks_total", m["gpu_blocks_total"]),
        ("minipaged_num_requests_waiting", m["num_requests_waiting"]),
        ("minipaged_num_steps_total", m["num_steps"]),
        ("minipaged_num_steps", None),  # only the counter (with _total) exists
        ("minipaged_gpu_blocks", None),  # a prefix of two real names, not a name
        ('minipaged_preemptions_total{mode="swap"}', m["preemptions_swap"]),
        ('minipaged_preemptions_total{mode="recompute"}', m["preemptions_recompute"]),
        *[(f'minipaged_requests_finished_total{{finish_reason="{r}"}}', finished.get(r))
          for r in ("abort", "length", "stop")],
        ("minipaged_engine_healthy", int(engine.is_running)),
    ]


@exercise
def check_metric_value(fn, num_cases: int = 60, seed: int | None = 0) -> CheckResult:
    from minipaged.entrypoints.api_server import prometheus_text

    learner = Learner("metric_value", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        engine = _stand_in_engine(rng)
        text = prometheus_text(engine)
        for name, expected in _questions(engine):
            got = learner(text, name)
            ok = (got is None) if expected is None else (
                isinstance(got, (int, float)) and not isinstance(got, bool)
                and float(got) == float(expected))
            if not ok:
                hint = ("a sample line is `name value` or `name{labels} value`; lines starting "
                        "with # are HELP and TYPE comments")
                if expected is None:
                    hint = (f"{name!r} is not the name of any sample: compare the whole name "
                            f"(with its labels) before the value, not just how the line starts")
                elif "{" in name:
                    hint = ("the labels are part of the sample's name: "
                            f"{name.split('{')[0]} has one sample per label value")
                fail(learner.name, case, f"metrics_text=<{len(text.splitlines())} lines of "
                     f"GET /metrics>, name={name!r}", got, expected, hint)
    return passed(learner, num_cases)


def usable(fn):
    """``fn`` for the lesson to read /metrics with once its check passed; until then the
    package's reader (``solutions.metric_value``)."""
    from minipaged.exercises import solutions

    return checking.usable("metric_value", fn, solutions.metric_value)


__all__ = ["check_stream_delta", "check_metric_value", "usable"]
