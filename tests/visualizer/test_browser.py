"""A real browser shows the block-table player, and moving its step slider changes the drawing.

The page is a notebook served by Voila on 127.0.0.1 (the kernel runs the widget's Python side);
Debian's Chromium opens it through playwright. Nothing is downloaded: Voila serves the widget
JavaScript from its own package, and playwright drives the system browser.

Slow: Voila and Chromium, about a minute on the 2-core machine; not measured this session.
"""
import json
import os
import sys
import textwrap

import pytest

from process_helpers import chromium_path, free_port, launch_chromium, running_process

pytestmark = [pytest.mark.slow, pytest.mark.lesson02]

NOTEBOOK_CODE = textwrap.dedent("""
    from minipaged import SamplingParams
    from minipaged.core.block_manager import BlockSpaceManager
    from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
    from visualizer import EventRecorder
    from visualizer.widgets import EventPlayer

    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    recorder = EventRecorder(bm)
    seqs = [Sequence(i, None, [1, 2, 3, 4, 5], 4) for i in range(2)]
    bm.allocate(SequenceGroup("0", seqs, SamplingParams(n=2), arrival_time=0.0))
    for seq in seqs:
        seq.status = SequenceStatus.RUNNING
    for token in (6, 7, 8):
        for seq in seqs:
            seq.append_token_id(token + 10 * seq.seq_id, {token + 10 * seq.seq_id: 0.0})
            bm.append_slot(seq)
    EventPlayer(recorder)
""")


def _write_notebook(path) -> None:
    notebook = {
        "cells": [{"cell_type": "code", "execution_count": None, "id": "player", "metadata": {},
                   "outputs": [], "source": NOTEBOOK_CODE}],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                    "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5,
    }
    path.write_text(json.dumps(notebook))


@pytest.fixture
def voila_page(tmp_path):
    pytest.importorskip("voila", reason="voila is not installed (pip install -e '.[test]')")
    notebook = tmp_path / "player.ipynb"
    _write_notebook(notebook)
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    cmd = [sys.executable, "-m", "voila", str(notebook), "--no-browser", f"--port={port}",
           "--Voila.ip=127.0.0.1", "--show_tracebacks=True"]
    with running_process(cmd, url, log_path=tmp_path / "voila.log", cwd=tmp_path,
                         env=dict(os.environ, JUPYTER_PLATFORM_DIRS="1")):
        yield url


def _drawing(page) -> str:
    return page.eval_on_selector(".minipaged-player-view svg.block-tables", "e => e.outerHTML")


def test_player_in_chromium_draws_and_follows_the_slider(voila_page):
    if chromium_path() is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            page = browser.new_page()
            page.goto(voila_page, timeout=120_000)
            # The drawing appears: the kernel ran the notebook and the widget rendered the SVG.
            page.wait_for_selector(".minipaged-player-view svg.block-tables", timeout=120_000)
            first = _drawing(page)
            assert 'data-num-seqs="0"' in first  # step 0: before anything was allocated
            assert page.inner_text(".minipaged-player-caption").startswith("step 0:")

            # Move the slider one step with the keyboard, as a user would.
            handle = page.locator(".widget-slider .noUi-handle").first
            handle.focus()
            handle.press("ArrowRight")
            # The caption and the drawing are two widget updates that may arrive apart:
            # wait for both.
            page.wait_for_function(
                "() => document.querySelector('.minipaged-player-caption')"
                ".innerText.startsWith('step 1:')", timeout=30_000)
            page.wait_for_function(
                "() => document.querySelector('.minipaged-player-view svg.block-tables')"
                ".outerHTML.includes('data-num-seqs=\"2\"')", timeout=30_000)
            second = _drawing(page)
            assert second != first
            assert 'data-num-seqs="2"' in second  # the request was admitted: two sequences
            assert 'class="physical-block used-block shared-block"' in second

            handle.press("End")  # the last step
            page.wait_for_function(
                "() => document.querySelector('.minipaged-player-caption')"
                ".innerText.startsWith('step 7:')", timeout=30_000)
            page.wait_for_function(
                "(seen) => !seen.includes(document.querySelector("
                "'.minipaged-player-view svg.block-tables').outerHTML)",
                arg=[first, second], timeout=30_000)
            assert _drawing(page) not in (first, second)
        finally:
            browser.close()
