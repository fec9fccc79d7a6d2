"""The web UI in a real headless browser (Debian's chromium driven by Playwright) against
real servers on 127.0.0.1: a tiny random Llama with the default model's tokenizer (its
steps slowed on demand, so a reply lasts as long as a test needs) and, once, the real
`roseinfer serve` process on the default model.

chromium and playwright missing is a FAILURE (CI installs both: `make setup`);
ROSEINFER_SKIP_BROWSER=1 skips this module instead.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from roseinfer.server.state import ServerSettings
from tests.server.helpers import TinyServer, wait_until
from tests.server.tokenizer_server import MODEL_NAME, tokenizer_server

pytestmark = pytest.mark.slow  # real browser and servers: `make test-fast` skips it

CHROMIUM = os.environ.get("ROSEINFER_CHROMIUM", "/usr/bin/chromium")
WAIT_MS = 30_000
META = re.compile(r"^(length|stop) · \d+ tokens · TTFT \d+\.\d\d s · \d+\.\d tok/s$")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if os.environ.get("ROSEINFER_SKIP_BROWSER") == "1":
        pytest.skip("ROSEINFER_SKIP_BROWSER=1: the web UI's browser tests are skipped")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        pytest.fail(f"playwright is missing ({exc}): `make setup` installs the test extra "
                    "(ROSEINFER_SKIP_BROWSER=1 skips these tests)", pytrace=False)
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: `make browser` (apt-get install -y chromium) "
                    "installs it (ROSEINFER_SKIP_BROWSER=1 skips these tests)", pytrace=False)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM)
        try:
            yield chromium
        finally:
            chromium.close()


class StepDelay:
    """Sleeps before each engine step while ``seconds`` > 0 (replies last longer)."""

    def __init__(self, engine: Any) -> None:
        self.seconds = 0.0
        inner = engine.step

        def step() -> Any:
            if self.seconds:
                time.sleep(self.seconds)
            return inner()

        engine.step = step


@pytest.fixture(scope="module")
def ui_server(browser: Any) -> Iterator[tuple[TinyServer, StepDelay]]:
    """(``browser`` first: without one, fail or skip before starting a server.)"""
    with tokenizer_server(ServerSettings(served_model_names=(MODEL_NAME,), ui=True)) as ts:
        yield ts, StepDelay(ts.engine)


@pytest.fixture
def ctx(browser: Any) -> Iterator[Any]:
    """A fresh browser context (empty localStorage); no page may throw."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    context.on("page", lambda page: page.on("pageerror", lambda e: errors.append(str(e))))
    context.set_default_timeout(WAIT_MS)
    try:
        yield context
    finally:
        context.close()
    assert not errors, errors


def chat_bodies(page: Any) -> list[dict[str, Any]]:
    """The JSON bodies the page posts to /v1/chat/completions (filled as it runs)."""
    bodies: list[dict[str, Any]] = []
    page.on("request", lambda r: bodies.append(r.post_data_json)
            if r.url.endswith("/v1/chat/completions") else None)
    return bodies


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_meta(page: Any) -> str:
    page.wait_for_selector(".msg.assistant:not(.streaming) .meta:not(:empty)")
    return page.locator(".msg.assistant .meta").last.inner_text()


def streaming_length(page: Any, more_than: int) -> int:
    """Waits until the reply being streamed has more than ``more_than`` characters."""
    page.wait_for_function(
        """n => { const b = document.querySelector('.msg.assistant.streaming .body');
                  return b !== null && b.textContent.length > n; }""", arg=more_than)
    return page.evaluate("document.querySelector('.msg.assistant.streaming .body')"
                         ".textContent.length")


def test_chat_streams_a_reply_and_keeps_the_conversation(ui_server, ctx) -> None:  # noqa: ANN001
    ts, delay = ui_server
    delay.seconds = 0.02
    page = ctx.new_page()
    bodies = chat_bodies(page)
    page.goto(ts.url + "/")
    page.wait_for_function(f"() => document.querySelector('#model-name').textContent === "
                           f"{json.dumps(MODEL_NAME)}")
    page.fill("#max-tokens", "60")
    page.fill("#temperature", "0")
    send(page, "Hello **there**")
    first = streaming_length(page, 0)  # the reply appears while it streams ...
    streaming_length(page, first)  # ... and grows
    meta = last_meta(page)
    assert META.match(meta), meta
    assert page.locator(".msg.user").inner_text().endswith("Hello **there**")  # plain text
    body = bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["model"]) == (60, 0, MODEL_NAME)
    assert body["messages"] == [{"role": "user", "content": "Hello **there**"}]
    assert page.locator(".msg.assistant .body").inner_text().strip()
    stored = "JSON.parse(localStorage.getItem('roseinfer.chat.messages'))"
    reply = page.evaluate(f"{stored}[1].content")
    assert reply

    page.reload()  # the conversation and the settings stay in the browser
    assert page.locator(".msg").count() == 2
    assert page.locator(".msg.assistant .meta").inner_text() == meta
    assert page.input_value("#max-tokens") == "60"
    send(page, "And again")
    last_meta(page)
    history = bodies[-1]["messages"]
    assert [m["role"] for m in history] == ["user", "assistant", "user"]
    assert history[1]["content"] == reply
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    page.reload()
    assert page.locator(".msg").count() == 0
    delay.seconds = 0.0


def test_stop_aborts_the_request_and_frees_its_blocks(ui_server, ctx) -> None:  # noqa: ANN001
    ts, delay = ui_server
    delay.seconds = 0.03
    aborted = ts.async_engine.stats().finished.get("abort", 0)
    dash = ctx.new_page()
    dash.goto(ts.url + "/#dashboard")
    page = ctx.new_page()
    page.goto(ts.url + "/")
    page.fill("#max-tokens", "900")
    send(page, "Tell me a very long story.")
    streaming_length(page, 0)
    dash.wait_for_function("() => document.querySelector('#stat-running').textContent === '1'")
    dash.wait_for_selector("#req-body tr td .state.decode")
    assert dash.inner_text("#stat-kv") != "0.0%"
    assert dash.locator("#req-body tr").count() == 1
    page.click("#stop")
    meta = last_meta(page)
    assert meta.startswith("stopped") and "tokens" in meta, meta
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    dash.wait_for_function("() => document.querySelector('#stat-running').textContent === '0' && "
                           "document.querySelector('#stat-kv').textContent === '0.0%'")
    dash.wait_for_selector("#req-empty", state="visible")
    assert dash.locator("#req-body tr").count() == 0
    summary = dash.inner_text("#kv-summary")
    kv_dtype = str(ts.engine.kv_dtype).removeprefix("torch.")
    assert summary.startswith("0 in use") and summary.endswith(f"tokens, {kv_dtype}"), summary
    bm = ts.engine.block_manager
    assert wait_until(lambda: ts.async_engine.stats().num_free_blocks == bm.num_blocks, 5)
    assert ts.async_engine.stats().finished.get("abort", 0) == aborted + 1
    delay.seconds = 0.0


def test_dashboard_moves_while_a_load_runs(ui_server, ctx) -> None:  # noqa: ANN001
    ts, delay = ui_server
    delay.seconds = 0.03
    dash = ctx.new_page()
    dash.goto(ts.url + "/#dashboard")
    dash.wait_for_function("() => document.querySelector('#stat-generated').textContent !== '–'")
    before = int(dash.inner_text("#stat-generated").replace(",", ""))
    ttft_before = int(dash.locator("#lat-ttft td").nth(3).inner_text())

    def one(i: int) -> None:
        body = {"model": MODEL_NAME, "max_tokens": 60, "ignore_eos": True, "stream": True,
                "messages": [{"role": "user", "content": f"Question number {i}?"}]}
        with httpx.stream("POST", ts.url + "/v1/chat/completions", json=body,
                          timeout=60) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        dash.wait_for_function("() => Number(document.querySelector('#stat-running').textContent)"
                               " >= 2")
        dash.wait_for_function("() => document.querySelectorAll('#req-body tr').length >= 2")
        dash.wait_for_function("() => /^[1-9]\\d* in use/.test("
                               "document.querySelector('#kv-summary').textContent)")
        dash.wait_for_function("() => Number(document.querySelector('#stat-decode').textContent)"
                               " > 0")
        for f in futures:
            f.result()
    dash.wait_for_function(f"() => Number(document.querySelector('#stat-generated').textContent"
                           f".replace(/,/g, '')) >= {before + 8 * 60}")
    dash.wait_for_function(f"() => Number(document.querySelectorAll('#lat-ttft td')[3]"
                           f".textContent) >= {ttft_before + 8}")
    assert dash.locator("#lat-itl td").first.inner_text().endswith("ms")
    dash.wait_for_function("() => document.querySelector('#stat-running').textContent === '0'")
    delay.seconds = 0.0


XSS = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'


def test_markdown_is_rendered_safely(ui_server, ctx) -> None:  # noqa: ANN001
    ts, _ = ui_server
    page = ctx.new_page()
    page.goto(ts.url + "/")
    cases = {
        "xss": XSS,
        "fence": "Run:\n```html\n<b>x</b> & y\n```\nafter",
        "inline": "**bold**, *it*, _em_, `a<b>` and ~~gone~~",
        "lists": "- a\n- b\n\n1. x\n2. y",
        "heading": "# Title\ntext\n\n> quoted",
        "open": "```py\nx = '<tag>'",
        "lang": '```" onmouseover="alert(1)\ncode\n```',
        "link": "[click](javascript:alert(1)) <a href='x'>a</a>",
    }
    html = page.evaluate("""async cases => {
        const md = await import('/ui/static/markdown.js');
        const out = {};
        for (const [k, v] of Object.entries(cases)) out[k] = md.renderMarkdown(v);
        return out; }""", cases)
    assert "<img" not in html["xss"] and "<script" not in html["xss"]
    assert "&lt;img src=x onerror=&quot;window.__pwned=1&quot;&gt;" in html["xss"]
    assert html["fence"] == ('<p>Run:</p>\n<pre><code class="language-html">&lt;b&gt;x&lt;/b&gt;'
                             ' &amp; y</code></pre>\n<p>after</p>')
    assert html["inline"] == ("<p><strong>bold</strong>, <em>it</em>, <em>em</em>, "
                              "<code>a&lt;b&gt;</code> and <del>gone</del></p>")
    assert html["lists"] == "<ul><li>a</li><li>b</li></ul>\n<ol><li>x</li><li>y</li></ol>"
    assert html["heading"] == ("<h3>Title</h3>\n<p>text</p>\n"
                               "<blockquote><p>quoted</p></blockquote>")
    assert html["open"] == '<pre><code class="language-py">x = &#39;&lt;tag&gt;&#39;</code></pre>'
    assert html["lang"] == "<pre><code>code</code></pre>"  # the quote is dropped
    assert "<a" not in html["link"]
    # A stored reply with markup is shown as text by the chat view, never run.
    messages = [{"role": "user", "content": XSS},
                {"role": "assistant", "content": XSS + "\n\n```\n" + XSS + "\n```", "meta": None}]
    page.evaluate("m => localStorage.setItem('roseinfer.chat.messages', JSON.stringify(m))",
                  messages)
    page.reload()
    page.wait_for_selector(".msg.assistant pre code")
    assert page.locator("#messages img, #messages script").count() == 0
    assert page.evaluate("window.__pwned") is None
    assert XSS in page.locator(".msg.assistant pre code").inner_text()


DEEP = ">" * 3000 + " deep"  # 3,000 nested quotes: overflowed the renderer's stack
FENCE_SOURCE = r"^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$"  # markdown.js's FENCE


def canned_reply(page: Any, text: str) -> None:
    """The page's next chat completions are answered with ``text`` as one SSE chunk."""
    events = [{"id": "c", "object": "chat.completion.chunk", "model": MODEL_NAME,
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                            "finish_reason": None}]},
              {"id": "c", "object": "chat.completion.chunk", "model": MODEL_NAME,
               "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=body))


def assert_idle(page: Any) -> None:
    page.wait_for_selector(".msg.assistant:not(.streaming) .meta:not(:empty)")
    assert page.is_enabled("#send") and page.is_disabled("#stop")
    assert page.get_attribute("#messages", "aria-busy") == "false"
    assert page.inner_text("#chat-status") == ""


def test_deep_markdown_is_bounded_and_never_leaves_the_chat_busy(ui_server, ctx) -> None:  # noqa: ANN001
    ts, _ = ui_server
    page = ctx.new_page()
    page.goto(ts.url + "/")
    max_depth, html, safe = page.evaluate("""async text => {
        const md = await import('/ui/static/markdown.js');
        return [md.MAX_DEPTH, md.renderMarkdown(text), md.renderMarkdownSafe(text)]; }""", DEEP)
    assert max_depth == 32 and html == safe
    assert html.count("<blockquote>") == 32 == html.count("</blockquote>")
    assert html.endswith("<p>" + "&gt;" * (3000 - 32) + " deep</p>" + "</blockquote>" * 32)
    # In the chat: the reply renders (32 quotes deep), the chat is free again, and the
    # stored conversation renders after a reload.
    canned_reply(page, DEEP)
    send(page, "Quote yourself")
    assert_idle(page)
    quotes = ".msg.assistant .body " + " > blockquote" * 32
    assert page.locator(quotes).count() == 1
    assert page.locator(quotes + " > blockquote").count() == 0
    page.reload()
    page.wait_for_selector(quotes)
    assert page.is_enabled("#send")
    # A renderer that throws anyway (forced here) shows the reply as plain text.
    page.evaluate("""source => { const exec = RegExp.prototype.exec;
        RegExp.prototype.exec = function (s) {
          if (this.source === source && String(s).includes('BOOM')) throw new Error('boom');
          return exec.call(this, s); }; }""", FENCE_SOURCE)
    assert page.evaluate("""async text => (await import('/ui/static/markdown.js'))
        .renderMarkdownSafe(text)""", "**BOOM** <b>x</b>\nnext") == (
        "<p>**BOOM** &lt;b&gt;x&lt;/b&gt;<br>next</p>")
    page.click("#new-chat")
    canned_reply(page, "**BOOM** <b>x</b>")
    send(page, "Break the renderer")
    assert_idle(page)
    assert page.locator(".msg.assistant .body").inner_text() == "**BOOM** <b>x</b>"
    assert page.locator(".msg.assistant .body b, .msg.assistant .body strong").count() == 0


def test_json_schema_and_settings_are_sent(ui_server, ctx) -> None:  # noqa: ANN001
    ts, _ = ui_server
    page = ctx.new_page()
    bodies = chat_bodies(page)
    page.goto(ts.url + "/")
    page.fill("#schema", "{not json")
    page.wait_for_selector("#schema-error:not(:empty)")
    send(page, "Give me JSON")
    page.wait_for_timeout(300)
    assert bodies == [] and page.input_value("#prompt") == "Give me JSON"  # nothing sent
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    page.fill("#schema", json.dumps(schema))
    page.fill("#system", "Answer in JSON.")
    page.fill("#seed", "7")
    page.fill("#top-p", "0.5")
    page.fill("#max-tokens", "24")
    page.click("#send")
    meta = last_meta(page)
    assert not meta.startswith("error"), meta
    body = bodies[0]
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "ui_schema", "schema": schema}}
    assert body["messages"][0] == {"role": "system", "content": "Answer in JSON."}
    assert (body["seed"], body["top_p"], body["max_tokens"]) == (7, 0.5, 24)
    page.reload()
    assert json.loads(page.input_value("#schema")) == schema and page.input_value("#seed") == "7"


def test_api_key_is_asked_once_kept_and_sent(ctx) -> None:  # noqa: ANN001
    settings = ServerSettings(served_model_names=(MODEL_NAME,), api_key="sekret", ui=True)
    with tokenizer_server(settings) as ts:
        page = ctx.new_page()
        auth: list[str | None] = []
        page.on("request", lambda r: auth.append(r.headers.get("authorization"))
                if "/v1/" in r.url or "/ui/api/" in r.url else None)
        page.goto(ts.url + "/#dashboard")  # the page itself is public
        page.wait_for_selector("#key-panel", state="visible")
        page.wait_for_function("() => document.querySelector('#dash-status').textContent"
                               ".includes('API key')")
        page.fill("#key-input", "sekret")
        page.press("#key-input", "Enter")
        page.wait_for_selector("#key-panel", state="hidden")
        page.wait_for_function("() => document.querySelector('#stat-running').textContent === '0'")
        page.wait_for_function(f"() => document.querySelector('#model-name').textContent === "
                               f"{json.dumps(MODEL_NAME)}")
        assert page.evaluate("localStorage.getItem('roseinfer.apiKey')") == "sekret"
        page.click("#nav-chat")
        page.fill("#max-tokens", "8")
        send(page, "hi")
        assert META.match(last_meta(page))
        assert auth[-1] == "Bearer sekret" and None in auth  # asked once, then sent
        again = ctx.new_page()  # a new page of the same browser: not asked again
        again.goto(ts.url + "/#dashboard")
        again.wait_for_function("() => document.querySelector('#stat-running').textContent === '0'")
        assert again.is_hidden("#key-panel")
        again.click("#key-button")  # a wrong key: asked again, with the reason
        again.fill("#key-input", "wrong")
        again.click("#key-save")
        again.wait_for_selector("#key-panel", state="visible")
        again.wait_for_function("() => document.querySelector('#key-why').textContent"
                                ".includes('refused')")


def test_narrow_window_and_keyboard(ui_server, browser) -> None:  # noqa: ANN001
    ts, _ = ui_server
    context = browser.new_context(viewport={"width": 360, "height": 740})
    try:
        page = context.new_page()
        for view in ("chat", "dashboard"):
            page.goto(f"{ts.url}/#{view}")
            page.wait_for_timeout(400)
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
            unlabelled = page.evaluate("""[...document.querySelectorAll('input, textarea')]
                .filter(e => !e.labels.length && !e.getAttribute('aria-label'))
                .map(e => e.id)""")
            assert unlabelled == []
        page.goto(ts.url + "/#chat")
        reached = set()
        for _ in range(25):
            page.keyboard.press("Tab")
            reached.add(page.evaluate("document.activeElement.id"))
        assert {"nav-chat", "nav-dashboard", "prompt", "send", "temperature"} <= reached
        page.focus("#nav-dashboard")
        page.keyboard.press("Enter")
        page.wait_for_selector("#view-dashboard", state="visible")
        assert page.is_hidden("#view-chat")
    finally:
        context.close()


def test_real_server_chat_and_dashboard(server, ctx) -> None:  # noqa: ANN001
    """`roseinfer serve` (the default model) serves the UI by default."""
    page = ctx.new_page()
    page.goto(server.url + "/")
    page.wait_for_function("() => document.querySelector('#model-name').textContent !== ''")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "24")
    send(page, "What is the capital of France?")
    assert META.match(last_meta(page))
    assert "Paris" in page.locator(".msg.assistant .body").inner_text()
    dash = ctx.new_page()
    dash.goto(server.url + "/#dashboard")
    dash.wait_for_function("() => Number(document.querySelector('#lat-ttft td:nth-of-type(4)')"
                           ".textContent) >= 1")
    assert dash.inner_text("#dash-status").startswith("live")
    snap = httpx.get(server.url + "/ui/api/snapshot", timeout=30).json()
    assert snap["model"] == "smollm2-test" and snap["tokens"]["generation_total"] > 0
