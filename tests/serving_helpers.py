"""Shared by the serving tests: a tiny model that has a real tokenizer, and `minipaged serve` in a
subprocess on a free port that always stops."""
from __future__ import annotations

import contextlib
import os
import sys
import time

import httpx

from process_helpers import free_port, running_process
from tiny_models import save_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    port = free_port()
    cmd = [sys.executable, "-m", "minipaged", "serve"] + ([model] if model else []) + [
        "--port", str(port), "--served-model-name", name, "--log-level", "warning", *flags]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    url = f"http://127.0.0.1:{port}"
    with running_process(cmd, url + "/health", log_path=log_path, timeout=timeout, cwd=ROOT,
                         env=env):
        yield url


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
