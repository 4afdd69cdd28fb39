"""Each lesson opens in JupyterLab in a real browser, runs all its cells, and shows no error.

JupyterLab is started on 127.0.0.1 over a copy of the lessons (so saving does not touch the
repository), as a learner first meets them: MINIPAGED_SOLUTIONS is unset, so every exercise still
says ``not_done()``, its checker says "not done yet" without raising, and the cells after it go
on with the package's own function. Debian's Chromium, driven by playwright, opens each notebook,
runs "Run All Cells", waits for the kernel, and saves. Then: no saved output is an error, every
widget output rendered in the page (no "Error displaying widget"), every code cell ran, and no
solution was filled in. The lesson's kernel is then shut down, so that no two lessons' models are
in memory at once. Nothing is downloaded.

This is the course's unanswered run; ``pytest --nbmake lessons`` is the answered one
(lessons/conftest.py sets MINIPAGED_SOLUTIONS=1 there). Each lesson's time is printed, and the
session ends with a table of the lessons' times and error cells (tests/lessons/conftest.py).

Slow: every lesson in JupyterLab in Chromium, several minutes on the 2-core machine.
"""
import json
import os
import shutil
import sys
import time
import urllib.request

import pytest

from process_helpers import chromium_path, free_port, launch_chromium, running_process
from repo_paths import ROOT

# Every lesson. 13 starts an HTTP server (uvicorn in a thread of the kernel, on a free port of
# 127.0.0.1) and its clients inside the notebook; 14 builds tensor-parallel shards in the kernel.
LESSONS = sorted(p.stem for p in (ROOT / "lessons").glob("*.ipynb"))

pytestmark = pytest.mark.slow

# (lesson, seconds of Run All, error cells) of each lesson run here: tests/lessons/conftest.py
# prints them as a table at the end of the session, so every full run shows the course's times.
RUN_ALL: list[tuple[str, float, list[str]]] = []


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")
    if chromium_path() is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    work = tmp_path_factory.mktemp("lab")
    for name in LESSONS:
        shutil.copy(ROOT / "lessons" / f"{name}.ipynb", work)
    port = free_port()
    # Render every cell (no windowing), so that the page holds every output to check.
    settings = work / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    # No "Would you like to get notified about Jupyter news?" toast over the outputs (and no
    # request to the news feed: nothing outside 127.0.0.1 is reached).
    notification = work / "settings" / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false", "checkForUpdates": false}')
    env = {k: v for k, v in os.environ.items() if k != "MINIPAGED_SOLUTIONS"}
    env.update(JUPYTER_PLATFORM_DIRS="1",
               JUPYTERLAB_SETTINGS_DIR=str(work / "settings"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
           "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=", "--ServerApp.password=",
           "--ServerApp.disable_check_xsrf=True", "--LabApp.expose_app_in_browser=True",
           f"--ServerApp.root_dir={work}", "--allow-root"]
    url = f"http://127.0.0.1:{port}"
    with running_process(cmd, url + "/api", log_path=work / "lab.log", cwd=work, env=env):
        yield url, work


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with sync_api.sync_playwright() as p:
        b = launch_chromium(p)
        try:
            yield b
        finally:
            b.close()


# Per code cell of the notebook model: its execution count (null while queued or running).
COUNTS = ("() => { const m = window.jupyterapp.shell.currentWidget.content.model;"
          " const out = []; for (let i = 0; i < m.cells.length; i++) {"
          " const c = m.cells.get(i); if (c.type === 'code') out.push(c.executionCount); }"
          " return out; }")
IDLE = "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"


def _wait_until_done(page, timeout: float = 400) -> None:
    """Every code cell has run, or the kernel stayed idle with cells left (an error stopped
    "Run All"; the checks below report it)."""
    deadline = time.monotonic() + timeout
    idle_polls, last = 0, None
    while time.monotonic() < deadline:
        page.wait_for_timeout(2000)
        counts = page.evaluate(COUNTS)
        if all(counts):
            return
        # Stopped: some cells ran, and for 20 s the kernel was idle and nothing changed.
        quiet = any(counts) and counts == last and page.evaluate(IDLE) == "idle"
        idle_polls = idle_polls + 1 if quiet else 0
        last = counts
        if idle_polls >= 10:
            return
    raise TimeoutError("the notebook was still running")


@pytest.mark.parametrize("name", LESSONS)
def test_lesson_runs_in_jupyterlab_without_errors(lab, browser, name):
    try:
        _run_lesson_in_jupyterlab(lab, browser, name)
    finally:
        # A closed tab leaves its kernel running, with the lesson's models in memory: sixteen of
        # them filled this 24 GiB machine, and the out-of-memory killer took the browser's tab.
        _shut_down_kernels(lab[0])


def _shut_down_kernels(url: str) -> None:
    """Every kernel of the lab is shut down (the server waits for each process to end)."""
    with urllib.request.urlopen(url + "/api/kernels", timeout=30) as response:
        kernels = json.loads(response.read())
    for kernel in kernels:
        request = urllib.request.Request(f"{url}/api/kernels/{kernel['id']}", method="DELETE")
        urllib.request.urlopen(request, timeout=60).close()
    with urllib.request.urlopen(url + "/api/kernels", timeout=30) as response:
        assert json.loads(response.read()) == [], "a lesson's kernel is still running"


def _run_lesson_in_jupyterlab(lab, browser, name):
    url, work = lab
    # Screenshots (MINIPAGED_SCREENSHOTS) in a tall window, so that a tall view fits in one
    height = 2600 if os.environ.get("MINIPAGED_SCREENSHOTS") else 900
    page = browser.new_page(viewport={"width": 1400, "height": height})
    try:
        # A fresh workspace per lesson: JupyterLab would otherwise reopen the previous tabs.
        page.goto(f"{url}/lab/workspaces/{name}/tree/{name}.ipynb?reset", timeout=120_000)
        page.wait_for_function(
            "name => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
            " return w && w.context && w.context.path.endsWith(name + '.ipynb')"
            " && document.querySelector('.jp-NotebookPanel .jp-Notebook .jp-Cell'); }",
            arg=name, timeout=120_000)
        # Wait for the kernel, then run everything, as a learner would from the Run menu.
        page.wait_for_function("() => { const w = window.jupyterapp.shell.currentWidget;"
                               " return w && w.sessionContext && w.sessionContext.session"
                               " && w.sessionContext.session.kernel"
                               " && w.sessionContext.session.kernel.connectionStatus"
                               " === 'connected'; }", timeout=120_000)
        start = time.perf_counter()
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        _wait_until_done(page)
        seconds = time.perf_counter() - start
        print(f"{name}: {seconds:.1f} s in JupyterLab, exercises unanswered")
        page.evaluate("window.jupyterapp.commands.execute('docmanager:save')")
        page.wait_for_timeout(1500)
        notebook = json.loads((work / f"{name}.ipynb").read_text())
        code = [c for c in notebook["cells"] if c["cell_type"] == "code"]
        errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(code)
                  for o in c.get("outputs", []) if o["output_type"] == "error"]
        RUN_ALL.append((name, seconds, [f"cell {i}: {ename}" for i, ename, _ in errors]))
        assert not errors, errors
        counts = [c.get("execution_count") for c in code]
        assert all(counts), f"some cells did not run: {counts}, in the page {page.evaluate(COUNTS)}"
        printed = "".join(o.get("text", "") if isinstance(o.get("text", ""), str)
                          else "".join(o["text"]) for c in code for o in c.get("outputs", [])
                          if o["output_type"] == "stream")
        if any("not_done()" in "".join(c["source"]) for c in code):
            assert "not done yet" in printed, "an unanswered checker must say so"
        assert "solution was used" not in printed, "nothing may fill in the answers here"
        widgets = sum("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                      for c in code for o in c.get("outputs", []))
        page_text = page.inner_text(".jp-NotebookPanel")
        assert "Error displaying widget" not in page_text
        rendered = page.locator(".jp-OutputArea-output .jupyter-widgets").count()
        assert rendered >= widgets, (rendered, widgets)
        svgs = page.locator(".jp-OutputArea-output svg, .jp-RenderedSVG").count()  # drawings
        assert svgs > 0
        shots = os.environ.get("MINIPAGED_SCREENSHOTS")  # a folder: keep pictures of the views
        if shots:
            for kind, selector in (("widget", ".jp-OutputArea-output .widget-vbox"),
                                   ("svg", ".jp-RenderedSVG")):
                for k, view in enumerate(page.locator(selector).all()):
                    view.scroll_into_view_if_needed()
                    view.screenshot(path=os.path.join(shots, f"{name}_{kind}{k}.png"))
    finally:
        page.close()
