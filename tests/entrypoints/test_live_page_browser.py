"""The live page in a real browser (lesson 13): Debian's Chromium, driven by playwright, chats in
two tabs at once against a server with an API key and a small KV pool, and checks that each
tab's streamed text is the API's answer for the same seed, that the block view follows the
steps (blocks taken, shared, then all free again) and that a preemption is drawn. Its two
screenshots go to $MINIPAGED_SCREENSHOTS_DIR when set (docs/img/'s were made so:
MINIPAGED_SCREENSHOTS_DIR=docs/img), else to a temporary folder.

Nothing is downloaded: playwright drives the system browser, the page loads only the server's
own files. Slow: Chromium and a served tiny model, about 30 s on the 2-core machine.
"""
import os
import time

import httpx
import pytest

from minipaged.entrypoints.api_server import ServerOptions
from minipaged.entrypoints.live_feed import LiveOptions
from process_helpers import chromium_path, launch_chromium
from repo_paths import ROOT
from serving_helpers import save_tiny_model_with_tokenizer, served_in_process

pytestmark = [pytest.mark.slow, pytest.mark.lesson13]
KEY = "browser-key"
ASKS = [("Tell me about the sea.", 7), ("Why is the sky blue?", 11)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if chromium_path() is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); "
                    "the browser test never downloads one")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    path = tmp_path_factory.mktemp("tiny_live_browser")
    save_tiny_model_with_tokenizer(path)
    # a small pool: two chats of this length cannot both hold their blocks (a preemption)
    options = ServerOptions(api_key=KEY, live=LiveOptions(interval=0.05))
    with served_in_process(str(path), "tiny", options, step_delay=0.04, num_gpu_blocks=24,
                           block_size=4, max_model_len=96, watermark=0.0) as (srv, engine):
        yield srv.url, engine


def api_answer(url: str, text: str, seed: int) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "seed": seed,
            "temperature": 0.8, "max_tokens": MAX_TOKENS}
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=120,
                       headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def open_tab(context, url: str):
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept(KEY))  # the page asks for the key once
    page.goto(url + "/", timeout=60_000)
    page.wait_for_function("() => document.body.dataset.step !== undefined", timeout=60_000)
    return page


def pool_of(page) -> tuple[int, int, int] | None:
    """(held, shared, free) as the page drew them last, or None before its first frame."""
    pool = page.evaluate("() => Object.assign({}, document.getElementById('blocks').dataset)")
    return (int(pool["held"]), int(pool["shared"]), int(pool["free"])) if pool else None


def ask(page, text: str, seed: int) -> None:
    page.fill("#temperature", "0.8")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#seed", str(seed))
    page.fill("#message", text)
    page.click("#send")


def test_two_tabs_chat_at_once_and_the_page_draws_the_steps(server, tmp_path):
    from playwright.sync_api import sync_playwright

    url, engine = server
    images = ROOT / os.environ.get("MINIPAGED_SCREENSHOTS_DIR", str(tmp_path))
    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            tabs = [open_tab(context, url) for _ in ASKS]
            seen = []  # (held, shared, free) as the first tab drew them
            before = tabs[0].evaluate("() => document.getElementById('blocks').dataset.held")
            # Paused from the page while both tabs ask, so that the two chats run together
            # however slowly a busy machine delivers the second (CI once saw the first finish
            # alone: nothing shared, no preemption); resumed once both are waiting.
            tabs[0].click("#pause")
            tabs[0].wait_for_function("() => document.getElementById('pause').textContent"
                                      " === 'Resume'", timeout=60_000)
            for tab, (text, seed) in zip(tabs, ASKS):
                ask(tab, text, seed)
            deadline = time.monotonic() + 120
            while len(engine.scheduler.waiting) < len(ASKS):
                assert time.monotonic() < deadline, "the two chats never reached the engine"
                time.sleep(0.05)
            # Two steps from the page while paused (the prefill of both, a decode), each waited
            # for until the page draws it: the feed sends at most a share of the time (SHARE),
            # so a busy machine may draw no frame of a short run at all.
            for _ in range(2):
                drawn = int(tabs[0].evaluate("() => document.body.dataset.step"))
                tabs[0].click("#step")
                tabs[0].wait_for_function(f"() => Number(document.body.dataset.step) > {drawn}",
                                          timeout=60_000)
                seen.append(pool_of(tabs[0]) or (0, 0, 0))
            tabs[0].click("#pause")  # (now labelled Resume)
            shot_taken = preemption_shot = False
            for _ in range(600):
                pool = pool_of(tabs[0])
                if pool:
                    seen.append(pool)
                if not shot_taken and seen and seen[-1][0] > 0:
                    tabs[0].wait_for_timeout(300)
                    tabs[0].screenshot(path=str(images / "live_page_two_tabs.png"))
                    shot_taken = True
                if not preemption_shot and tabs[0].locator("#event-log li").count():
                    tabs[0].screenshot(path=str(images / "live_page_preemption.png"))
                    preemption_shot = True
                if all(t.evaluate("() => !!document.querySelector('.assistant[data-done]')")
                       for t in tabs):
                    break
                tabs[0].wait_for_timeout(50)
            streamed = [t.inner_text(".assistant .choice") for t in tabs]
            # the pool is all free again once both finished, and the page says so: its frame
            # of the engine's last step (not an older one that also had no block held)
            last = engine.stats.num_steps
            tabs[0].wait_for_function(f"() => Number(document.body.dataset.step) >= {last}",
                                      timeout=60_000)
            tabs[0].wait_for_function(
                "() => document.getElementById('blocks').dataset.held === '0'", timeout=30_000)
            log = tabs[0].inner_text("#event-log")
        finally:
            browser.close()
    assert engine.stats.num_preemptions_recompute + engine.stats.num_preemptions_swap > 0
    assert "preempted" in log  # drawn in the page's log as it happened
    assert before == "0" and max(h for h, _, _ in seen) > 0  # blocks taken, from none
    assert max(s for _, s, _ in seen) > 0  # the chat template's prefix shared by both
    for text, (prompt, seed) in zip(streamed, ASKS):
        assert text == api_answer(url, prompt, seed)
