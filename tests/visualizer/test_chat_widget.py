"""The notebook's chat widget (lesson 13): its answer is the API's, streamed into the widget, and
the server's drawing of the blocks arrives under it."""
import time

import httpx
import pytest

pytest.importorskip("ipywidgets")

from minipaged.entrypoints.api_server import ServerOptions  # noqa: E402
from serving_helpers import save_tiny_model_with_tokenizer, served_in_process  # noqa: E402
from visualizer.chat_widget import ChatWidget  # noqa: E402

pytestmark = pytest.mark.lesson13


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_chat_widget")
    save_tiny_model_with_tokenizer(path)
    with served_in_process(str(path), "tiny", ServerOptions(api_key="k"), step_delay=0.02,
                           num_gpu_blocks=40, block_size=8, max_model_len=128) as (srv, _):
        yield srv.url


def test_the_widget_streams_the_apis_answer_and_draws_the_blocks(server):
    chat = ChatWidget(server, "tiny", api_key="k", max_tokens=12)
    try:
        chat.send("Hello there")
        answer = chat.wait(60)
        expected = httpx.post(server + "/v1/chat/completions", headers={"Authorization": "Bearer k"},
                              json={"model": "tiny", "max_tokens": 12, "temperature": 0,
                                    "messages": [{"role": "user", "content": "Hello there"}]},
                              timeout=60).json()["choices"][0]["message"]["content"]
        assert answer == expected and answer
        assert chat.history[-1] == {"role": "assistant", "content": answer}
        deadline = time.monotonic() + 30
        while chat.num_frames == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "block-tables" in chat.blocks.value and "scheduler-view" in chat.blocks.value
    finally:
        chat.close()


def test_a_refused_key_is_said_in_the_widget(server):
    chat = ChatWidget(server, "tiny", api_key="wrong")
    try:
        chat.send("Hi")
        assert chat.wait(30) == ""
        assert "incorrect API key" in chat.transcript.value
        deadline = time.monotonic() + 30
        while "HTTP 401" not in chat.blocks.value:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        chat.close()
