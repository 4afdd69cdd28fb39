"""A chat with a running server inside JupyterLab, the block tables redrawn under it (lesson 13).

    chat = ChatWidget(server.url, "smollm2")     # a text box, Send, the answer, the blocks
    chat                                         # shown in the notebook
    chat.send("Why is the sky blue?")            # what Send does (also from code)
    chat.wait()                                  # until the answer has finished

The answer streams from the server's ``/v1/chat/completions``; the drawing is the live page's
(``/live/events``: the lessons' own ``render_block_tables`` and ``render_scheduler``, made by the
server), so the notebook shows what a browser on ``/`` shows. Both run in threads of their own:
the notebook stays free while the answer comes. ``close()`` ends the drawing's stream.
"""
from __future__ import annotations

import json
import threading

import httpx
import ipywidgets as W

from visualizer.widgets import _figure_html


class ChatWidget(W.VBox):
    """Chat with the server at ``url`` (serving ``model``); ``api_key`` if it has one.

    ``answers`` holds each finished answer's text, ``num_frames`` the drawings received.
    """

    def __init__(self, url: str, model: str, api_key: str | None = None,
                 max_tokens: int = 64, temperature: float = 0.0) -> None:
        self.url, self.model = url.rstrip("/"), model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.history: list[dict] = []
        self.answers: list[str] = []
        self.num_frames = 0
        self._done = threading.Event()
        self._done.set()
        self._closed = threading.Event()
        self.message = W.Text(placeholder="Type a message, then Send",
                              layout=W.Layout(width="60%"))
        self.button = W.Button(description="Send")
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=4096,
                                           description="max tokens")
        self.temperature = W.BoundedFloatText(value=temperature, min=0, max=2, step=0.1,
                                              description="temperature")
        self.transcript = W.HTML("")
        self.blocks = W.HTML("<i>waiting for the server's first step…</i>")
        self.button.on_click(lambda _: self.send(self.message.value))
        super().__init__([W.HBox([self.message, self.button]),
                          W.HBox([self.temperature, self.max_tokens]),
                          self.transcript, self.blocks])
        self._follower = threading.Thread(target=self._follow, daemon=True,
                                          name="minipaged-chat-blocks")
        self._follower.start()

    def send(self, text: str) -> None:
        """Send ``text`` as the next user message; the answer streams into the widget."""
        text = text.strip()
        if not text or not self._done.is_set():
            return
        self.message.value = ""
        self._done.clear()
        self.history.append({"role": "user", "content": text})
        threading.Thread(target=self._answer, daemon=True, name="minipaged-chat").start()

    def wait(self, timeout: float = 120.0) -> str:
        """Wait for the answer being streamed; returns it (TimeoutError if it does not end)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"no complete answer within {timeout} s")
        return self.answers[-1] if self.answers else ""

    def close(self) -> None:
        self._closed.set()
        super().close()

    # -- the threads -------------------------------------------------------------------------
    def _answer(self) -> None:
        body = {"model": self.model, "messages": self.history, "stream": True,
                "max_tokens": self.max_tokens.value, "temperature": self.temperature.value}
        text = ""
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              headers=self.headers, timeout=300) as reply:
                if reply.status_code != 200:
                    raise RuntimeError(json.loads(reply.read())["error"]["message"])
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(chunk["error"]["message"])
                    for choice in chunk["choices"]:
                        text += choice["delta"].get("content") or ""
                    self._show(text)
            self.history.append({"role": "assistant", "content": text})
            self.answers.append(text)
        except (httpx.HTTPError, RuntimeError) as e:
            self.history.pop()
            self._show(text, error=str(e))
        finally:
            self._done.set()

    def _show(self, answer: str, error: str | None = None) -> None:
        import html

        turns = [f"<b>{'you' if m['role'] == 'user' else 'engine'}:</b> "
                 f"{html.escape(m['content'])}" for m in self.history]
        turns.append(f"<b>engine:</b> {html.escape(answer)}")
        if error:
            turns.append(f'<span style="color:#d62728">{html.escape(error)}</span>')
        self.transcript.value = "<br>".join(turns)

    def _follow(self) -> None:
        """Redraw the blocks from the server's live event stream until closed."""
        try:
            with httpx.stream("GET", self.url + "/live/events", headers=self.headers,
                              timeout=None) as reply:
                if reply.status_code != 200:
                    self.blocks.value = f"<i>no live drawing: HTTP {reply.status_code}</i>"
                    return
                for line in reply.iter_lines():
                    if self._closed.is_set():
                        return
                    if line.startswith("data:"):
                        frame = json.loads(line[5:])
                        if "svg" in frame:
                            self.blocks.value = _figure_html(frame["svg"]["queues"],
                                                             frame["svg"]["blocks"])
                            self.num_frames += 1
        except httpx.HTTPError:
            pass  # the server stopped
