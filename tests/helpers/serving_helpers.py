"""Shared by the serving tests: a tiny model that has a real tokenizer, `minipaged serve` in a
subprocess on a free port that always stops, the same app in this process, and a sampler of a
process's resident memory."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import httpx

from process_helpers import free_port, running_process
from repo_paths import ROOT
from tiny_models import save_tiny_model



def save_tiny_model_with_tokenizer(path, kind: str = "llama"):
    """A random tiny model with the embedded SmolLM2's tokenizer (and so its chat template).

    Its vocabulary is SmolLM2's, so text prompts tokenize to valid ids and outputs decode to text.
    """
    from transformers import AutoTokenizer

    from minipaged.worker.checkpoint import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    model = save_tiny_model(kind, path, vocab_size=len(tokenizer),
                            eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(path)
    return model, tokenizer


@contextlib.contextmanager
def running_server(model: str | None, *flags: str, name: str = "test-model", log_path=None,
                   timeout: float = 240.0):
    """Yield the base URL of `minipaged serve` in a subprocess; terminate it afterwards."""
    with running_server_process(model, *flags, name=name, log_path=log_path,
                                timeout=timeout) as (url, _):
        yield url


@contextlib.contextmanager
def running_server_process(model: str | None, *flags: str, name: str = "test-model",
                           log_path=None, timeout: float = 240.0, env: dict | None = None):
    """As ``running_server``, yielding (base URL, the server's Popen); ``env`` adds variables."""
    port = free_port()
    cmd = [sys.executable, "-m", "minipaged", "serve"] + ([model] if model else []) + [
        "--port", str(port), "--served-model-name", name, "--log-level", "warning", *flags]
    env = dict(os.environ, **(env or {}),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    url = f"http://127.0.0.1:{port}"
    with running_process(cmd, url + "/health", log_path=log_path, timeout=timeout, cwd=ROOT,
                         env=env) as proc:
        yield url, proc


@contextlib.contextmanager
def served_in_process(model_dir: str, name: str, options=None, step_delay: float = 0.0,
                      **engine_kwargs):
    """Yield (BackgroundServer, LLMEngine): the server's app on a free 127.0.0.1 port in a
    thread of this process; ``step_delay`` seconds are added to every engine step."""
    from minipaged.engine.async_llm_engine import AsyncLLMEngine
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.entrypoints.api_server import BackgroundServer, build_app

    from minipaged.sampling_params import SamplingParams

    engine = LLMEngine(model_dir, **engine_kwargs)
    # NOTE: one step before serving, untimed: the first may build (or wait for another process
    # building) the C++ CPU attention, which no test of the HTTP layer should time.
    engine.add_request("warm-up", None, SamplingParams(max_tokens=1), [5, 6])
    while engine.has_unfinished_requests():
        engine.step()
    if step_delay:
        engine.add_observer(lambda snapshot: time.sleep(step_delay))
    with BackgroundServer(build_app(AsyncLLMEngine(engine), name, options)) as server:
        yield server, engine


class MemorySampler:
    """Sample a process's resident memory (bytes) every ``interval`` s in a thread, while used
    as ``with MemorySampler(pid) as m``; ``m.peak`` is the largest sample, ``m.now()`` a new
    one."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        import psutil

        self.process = psutil.Process(pid)
        self.interval, self.peak = interval, self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        return self.process.memory_info().rss

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.now())

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, self.now())


def read_metrics(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def wait_for_metrics(url: str, condition, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until ``condition(metrics)`` holds; fail with the last values if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(url)
        if condition(metrics):
            return metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"metrics never reached the condition: {metrics}")
        time.sleep(0.1)
