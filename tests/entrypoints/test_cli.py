"""The command line: every engine option is a flag of `generate` and `serve`, the flags reach the
engine, and `generate --stream` prints text as it is generated (lessons 08 and 13).

Slow (left out of `make test`): the streaming test (a subprocess that loads the embedded model),
about 16 s on the 2-core machine (measured at load ~15).
"""
import argparse
import io
import subprocess
import sys
from dataclasses import fields

import pytest

from minipaged.config import EngineConfig
from minipaged.entrypoints import cli
from minipaged.engine.llm_engine import LLMEngine
from serving_helpers import ROOT, save_tiny_model_with_tokenizer

pytestmark = pytest.mark.lesson13


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_cli")
    save_tiny_model_with_tokenizer(path)
    return str(path)


def _help(command: str) -> str:
    run = subprocess.run([sys.executable, "-m", "minipaged", command, "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return " ".join(run.stdout.split())  # argparse wraps lines: compare words, not lines


def test_every_engine_setting_is_a_flag_with_the_configs_default():
    settings = {f.name: f for f in fields(EngineConfig)}
    options = {name: (kind, default) for name, kind, _, default, _ in cli.engine_options()}
    assert set(options) == set(settings) - set(cli.NOT_FLAGS)
    for name, (kind, default) in options.items():
        assert default == settings[name].default
        if default is not None:  # (None: the engine decides; a flag must be given a value)
            assert isinstance(default, kind) or kind is str, name
    # a flag given its default's text reaches the engine as that default
    parser = argparse.ArgumentParser()
    cli.add_engine_options(parser)
    argv = []
    for name, kind, _, default, _ in cli.engine_options():
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            argv.append(flag if default else f"--no-{flag[2:]}")
        elif default is not None:
            argv += [flag, str(default)]
    given = cli.engine_kwargs(parser.parse_args(argv))
    assert given == {name: default for name, _, _, default, _ in cli.engine_options()
                     if default is not None}
    assert cli.engine_kwargs(parser.parse_args([])) == {}  # nothing given, nothing passed


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_lists_every_engine_flag_with_its_help_and_default(command):
    text = _help(command)
    for name, kind, help_text, default, choices in cli.engine_options():
        flag = "--" + name.replace("_", "-")
        assert flag in text
        if kind is bool:
            assert f"{flag}, --no-{flag[2:]}" in text
        if choices:
            assert f"{flag} {{{','.join(choices)}}}" in text
        described = help_text + (f" (default: {default})" if default is not None else "")
        assert " ".join(described.split()) in text
    for flag in ("--tensor-parallel-size", "--worker-timeout", "--no-enable-prefix-caching",
                 "--no-enable-chunked-prefill", "--num-gpu-blocks", "--preemption-mode"):
        assert flag in text


def _serve_engine(monkeypatch, *argv) -> tuple[int, LLMEngine | None]:
    """Run `minipaged serve ...` in this process up to where it would start serving."""
    import minipaged.entrypoints.api_server

    served = {}
    monkeypatch.setattr(minipaged.entrypoints.api_server, "serve",
                        lambda async_engine, name, *args: served.update(engine=async_engine.engine,
                                                                        name=name))
    code = cli.main(["serve", *argv])
    return code, served.get("engine")


def test_serve_flags_reach_the_engine(monkeypatch, tiny_dir):
    code, engine = _serve_engine(
        monkeypatch, tiny_dir, "--num-gpu-blocks", "40", "--max-model-len", "200",
        "--block-size", "8", "--max-num-seqs", "3", "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill", "--preemption-mode", "swap", "--seed", "5")
    assert code == 0
    assert engine.block_manager.num_total_gpu_blocks == 40 and engine.block_size == 8
    assert engine.max_model_len == 200 and engine.seed == 5
    assert not engine.block_manager.enable_prefix_caching
    config = engine.scheduler_config
    assert (config.max_num_seqs, config.enable_chunked_prefill, config.preemption_mode) == \
        (3, False, "swap")
    code, engine = _serve_engine(monkeypatch, tiny_dir, "--num-gpu-blocks", "40",
                                 "--max-model-len", "200")
    assert engine.block_manager.enable_prefix_caching  # on unless turned off
    assert engine.scheduler_config.enable_chunked_prefill


def test_tensor_parallel_flags_reach_the_engine(monkeypatch, tiny_dir, capsys):
    # the tiny LLaMA has 4 heads and 2 kv heads: refused before any worker starts
    code, engine = _serve_engine(monkeypatch, tiny_dir, "--tensor-parallel-size", "3")
    assert (code, engine) == (2, None)
    assert "tensor_parallel_size 3 does not divide" in capsys.readouterr().err
    code, _ = _serve_engine(monkeypatch, tiny_dir, "--tensor-parallel-size", "2",
                            "--worker-timeout", "0")
    assert code == 2
    assert "worker_timeout must be a number of seconds > 0, got 0.0" in capsys.readouterr().err


def test_generate_trace_writes_the_steps_for_perfetto(tiny_dir, tmp_path, capsys):
    from trace_reader import read_trace, tracks

    path = tmp_path / "steps.json"
    code = cli.main(["generate", "Hello", "Hi there", "--model", tiny_dir, "--max-tokens", "4",
                     "--num-gpu-blocks", "40", "--max-model-len", "200", "--trace", str(path)])
    assert code == 0, capsys.readouterr().err
    steps, per_request, counters = tracks(read_trace(path))  # closed: generate shut down
    assert len(per_request) == 2 and all(e[-1]["name"] == "finished"
                                         for e in per_request.values())
    assert [e["name"] for e in steps[:6]] == ["step 1", "schedule", "prepare", "model",
                                              "sample", "update"]
    assert counters


class _Stdout(io.StringIO):
    """Remembers, for each write, how many engine steps had run."""

    def __init__(self, steps: list) -> None:
        super().__init__()
        self.steps, self.writes = steps, []

    def write(self, text: str) -> int:
        if text.strip():
            self.writes.append((len(self.steps), text))
        return super().write(text)


@pytest.mark.slow
def test_generate_stream_prints_text_as_it_comes_and_the_same_text(monkeypatch, tiny_dir):
    argv = ["generate", "Once upon a time", "The sky is", "--model", tiny_dir, "--chat",
            "--max-tokens", "24", "--temperature", "0.8", "--seed", "3", "--num-gpu-blocks",
            "64", "--max-model-len", "256"]
    steps = []
    real_step = LLMEngine.step

    def counted_step(self):
        steps.append(1)
        return real_step(self)

    monkeypatch.setattr(LLMEngine, "step", counted_step)
    whole = _Stdout(steps)
    monkeypatch.setattr(sys, "stdout", whole)
    assert cli.main(argv) == 0
    steps.clear()
    streamed = _Stdout(steps)
    monkeypatch.setattr(sys, "stdout", streamed)
    assert cli.main(argv + ["--stream"]) == 0
    monkeypatch.undo()

    assert streamed.getvalue() == whole.getvalue()  # the same text, the same layout
    assert whole.getvalue().startswith("### Once upon a time\n")
    answers = whole.getvalue().split("### ")[1:]
    assert len(answers) == 2 and all(len(a.split("\n", 1)[1].strip()) > 0 for a in answers)
    # the first answer arrived piece by piece while the engine stepped, not all at the end
    first_answer = [step for step, text in streamed.writes[1:] if not text.startswith("###")]
    assert len(first_answer) > 3
    assert len(set(first_answer)) > 3 and min(first_answer) < len(steps) // 2
