"""The live page over HTTP (lesson 13): served by the package with nothing from elsewhere, its
event stream behind the API key, no request text unless turned on, a limit on open streams, an
abandoned stream that costs the engine nothing, and pause / single step.

The server runs in this process on a free 127.0.0.1 port with a tiny random LLaMA.
"""
import http.client
import json
import re
import socket
import threading
import time
import xml.etree.ElementTree as ET

import httpx
import pytest

from minipaged.entrypoints.api_server import ServerOptions
from minipaged.entrypoints.live_feed import LiveFeed, LiveOptions
from minipaged.sampling_params import SamplingParams
from serving_helpers import save_tiny_model_with_tokenizer, served_in_process

pytestmark = pytest.mark.lesson13
KEY = "live-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SECRET = "purple elephants dance at midnight"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_live")
    save_tiny_model_with_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def served(tiny_dir):
    """(base URL, LLMEngine, AsyncLLMEngine, LiveFeed) with a key and at most 2 streams."""
    options = ServerOptions(api_key=KEY, live=LiveOptions(max_streams=2, interval=0.02))
    # (steps slowed to 30 ms, so that a page sees a chat while it runs)
    with served_in_process(tiny_dir, "tiny", options, step_delay=0.03, num_gpu_blocks=24,
                           block_size=4, max_model_len=96) as (server, engine):
        feed = server.app.state.live_feed
        yield server.url, engine, feed.async_engine, feed


def chat(url: str, text: str, max_tokens: int = 8, **extra) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, **extra}
    reply = httpx.post(url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


class Frames:
    """Read /live/events in a thread, keeping every frame (as raw text and parsed)."""

    def __init__(self, url: str, headers=AUTH) -> None:
        self.raw, self.frames, self.status = [], [], None
        self._stop = threading.Event()
        self._opened = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, headers), daemon=True)
        self._thread.start()
        assert self._opened.wait(30)

    def _read(self, url, headers) -> None:
        try:
            self._read_frames(url, headers)
        except (OSError, http.client.HTTPException):  # hung up by close()
            pass

    def _read_frames(self, url, headers) -> None:
        host, port = url.removeprefix("http://").split(":")
        self._conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self._conn.request("GET", "/live/events", headers=headers)
        reply = self._conn.getresponse()
        self.status = reply.status
        if reply.status != 200:
            self.body = reply.read()
            self._opened.set()
            return
        self._opened.set()
        for line in reply:
            if line.startswith(b"data:"):
                self.raw.append(line[5:].decode().strip())
                self.frames.append(json.loads(line[5:]))
            if self._stop.is_set():
                return

    def wait_for(self, condition, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for frame in list(self.frames):
                if condition(frame):
                    return frame
            time.sleep(0.02)
        raise AssertionError(f"no such frame in {len(self.frames)} frames")

    def close(self) -> None:
        """Hang up at once, as a closed tab does."""
        self._stop.set()
        if getattr(self, "_conn", None) is not None and self._conn.sock is not None:
            self._conn.sock.shutdown(socket.SHUT_RDWR)  # (wakes the reader blocked on it)
        self._thread.join(10)


def test_the_page_and_its_files_come_from_the_package_and_load_nothing_else(served):
    url = served[0]
    page = httpx.get(url + "/")  # the page holds no data: open without the key
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'data-model="tiny"' in page.text and 'data-needs-key="true"' in page.text
    sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(sources) == ["/live/static/live.css", "/live/static/live.js"]
    for source in sources:
        reply = httpx.get(url + source)
        assert reply.status_code == 200
        assert not re.search(r"https?://|//cdn|@import", reply.text), source
    assert httpx.get(url + "/live/static/../api_server.py").status_code == 404
    assert httpx.get(url + "/live/static/other.js").status_code == 404
    assert "/live/events" not in httpx.get(url + "/openapi.json").text  # not part of the API


def test_the_event_stream_and_the_controls_need_the_key(served):
    url = served[0]
    for method, path in (("GET", "/live/events"), ("POST", "/live/control")):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            reply = httpx.request(method, url + path, headers=headers, json={"action": "pause"})
            assert reply.status_code == 401, (path, reply.text)
            assert reply.json()["error"]["code"] == "invalid_api_key"
    bad = httpx.post(url + "/live/control", headers=AUTH, json={"action": "explode"})
    assert bad.status_code == 400 and "pause, resume, step" in bad.json()["error"]["message"]


def test_frames_follow_the_steps_drawn_by_the_visualizer_and_hide_the_text(served):
    url, engine, _, feed = served
    frames = Frames(url)
    try:
        first = frames.wait_for(lambda f: True)  # the state before any step is sent at once
        assert first["pool"]["free"] == first["pool"]["total"] == 24
        answer = chat(url, SECRET, max_tokens=40)
        busy = frames.wait_for(lambda f: f["tables"])
        assert busy["pool"]["held"] > 0 and busy["tables"][0]["block_table"]
        svg = ET.fromstring(busy["svg"]["blocks"])  # the lessons' block-table drawing
        assert svg.get("class") == "block-tables" and svg.get("data-num-gpu-blocks") == "24"
        assert ET.fromstring(busy["svg"]["queues"]).get("class") == "scheduler-view"
        done = frames.wait_for(lambda f: f["stats"]["num_sampled_tokens"] >=
                               answer["usage"]["completion_tokens"] and not f["tables"])
        assert done["pool"]["free"] == 24  # every block back at the end
        # other clients' text never reaches a page: not the prompt, not the answer, not ids
        words = [w for w in SECRET.split() + answer["choices"][0]["message"]["content"].split()
                 if len(w) > 3]
        for raw in frames.raw:
            assert "token_ids" not in raw and '"text"' not in raw
            assert not any(w in raw for w in words), [w for w in words if w in raw]
    finally:
        frames.close()


def test_show_text_puts_each_sequences_text_in_the_frames(served):
    _, engine, async_engine, _ = served
    feed = LiveFeed(async_engine, LiveOptions(show_text=True))
    snaps, done = [], threading.Event()

    def one_step(engine):  # (in the engine thread, the only one that may step it)
        engine.add_observer(snaps.append)
        try:
            engine.add_request("shown", None, SamplingParams(max_tokens=2, temperature=0),
                               engine.encode(SECRET))
            engine.step()
        finally:
            engine.remove_observer(snaps.append)
            engine.abort_request("shown")
            done.set()

    async_engine.call_in_engine_thread(one_step)
    assert done.wait(60)
    frame = feed.frame_of(snaps[-1])
    assert SECRET in "".join(frame["text"].values())
    hidden = LiveFeed(async_engine, LiveOptions()).frame_of(snaps[-1])
    assert "text" not in hidden and SECRET not in json.dumps(hidden)


def test_open_streams_are_limited_and_a_closed_one_costs_the_engine_nothing(served):
    """(While a page is open the engine builds a snapshot only when asked, at most one per
    interval for all pages; once the last is gone it builds none.)"""
    url, engine, _, feed = served
    observers = list(engine._observers)  # (the fixture's step delay)
    streams = [Frames(url), Frames(url)]
    try:
        assert [s.status for s in streams] == [200, 200]
        third = Frames(url)
        assert third.status == 503 and b"too_many_streams" in third.body
        for s in streams:
            s.wait_for(lambda f: True)
    finally:
        for s in streams:
            s.close()
    # once the last stream is gone the engine builds no snapshot for it
    deadline = time.monotonic() + 30
    while feed.num_streams or engine._observers != observers:
        assert time.monotonic() < deadline, (feed.num_streams, engine._observers)
        time.sleep(0.05)
    again = Frames(url)
    assert again.status == 200  # and a new page may open
    again.close()


def test_a_stream_never_read_does_not_hold_the_engine_back(served):
    url, engine, _, feed = served
    with httpx.stream("GET", url + "/live/events", headers=AUTH, timeout=60) as reply:
        assert reply.status_code == 200  # opened, then never read
        started = time.monotonic()
        answer = chat(url, "keep going", max_tokens=24)
        assert answer["usage"]["completion_tokens"] > 0
        assert time.monotonic() - started < 60


def test_pause_holds_the_steps_and_step_runs_exactly_one(served):
    url, engine, async_engine, _ = served

    def control(action):
        reply = httpx.post(url + "/live/control", headers=AUTH, json={"action": action})
        assert reply.status_code == 200, reply.text

    control("pause")
    result = {}
    worker = threading.Thread(target=lambda: result.update(chat(url, "hello", max_tokens=6)))
    worker.start()
    time.sleep(0.5)
    steps = engine.stats.num_steps
    time.sleep(0.5)
    assert engine.stats.num_steps == steps and worker.is_alive()  # held
    control("step")
    deadline = time.monotonic() + 30
    while engine.stats.num_steps == steps:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    time.sleep(0.3)
    assert engine.stats.num_steps == steps + 1  # one step, then held again
    control("resume")
    worker.join(60)
    assert result["usage"]["completion_tokens"] == 6


def test_serve_flags_set_the_live_page():
    import argparse

    from minipaged.entrypoints import cli

    parser = argparse.ArgumentParser()
    cli.add_server_options(parser)
    default = cli.server_options(parser.parse_args([])).live
    assert (default.show_text, default.max_streams) == (False, 4)
    live = cli.server_options(parser.parse_args(["--live-show-text", "--max-live-streams", "9"]))
    assert (live.live.show_text, live.live.max_streams) == (True, 9)
    assert cli.server_options(parser.parse_args(["--no-live-page"])).live is None
    with pytest.raises(ValueError, match="max_live_streams must be an integer >= 1, got 0"):
        cli.server_options(parser.parse_args(["--max-live-streams", "0"]))


def test_a_page_that_paused_the_engine_and_went_away_leaves_it_running(served):
    url, engine, async_engine, feed = served
    page = Frames(url)
    try:
        page.wait_for(lambda f: True)
        reply = httpx.post(url + "/live/control", headers=AUTH, json={"action": "pause"})
        assert reply.status_code == 200
        page.wait_for(lambda f: f["paused"])
    finally:
        page.close()  # the last page goes: the engine steps again
    deadline = time.monotonic() + 30
    while async_engine.paused:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert chat(url, "still there?", max_tokens=3)["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("host,needs_key,allowed", [
    ("127.0.0.1", False, True), ("::1", False, True), ("127.0.0.5", False, True),
    ("10.1.2.3", False, False), ("192.168.0.9", False, False), (None, False, False),
    ("10.1.2.3", True, True)])  # with a key, the key decides (auth.py)
def test_without_a_key_only_this_machine_may_pause_the_engine(host, needs_key, allowed):
    from minipaged.entrypoints.live_routes import may_control

    assert may_control(host, needs_key) is allowed
