"""The chat page in a real headless Chromium (Debian's ``chromium``, driven by Playwright through its path; see
scripts/install-chromium) against the suite's shared server (the default model, API key on): a message answered
in streamed text, stop, reload, settings in the request, the server's errors, export and import, the Markdown,
edit/regenerate/continue, phone width, a 500-message conversation and a path prefix; in each, no request leaves
the page's origin. One browser for the module, a fresh context (empty storage) per test."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import sync_playwright

from tests.server.conftest import start_server, stop_server
from tests.server.helpers import API_KEY

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 120_000  # a generous deadline for anything that waits on the model (the machine may be loaded)
SHORT = json.dumps({"temperature": "0", "max_tokens": "3"})  # the model is slow on a loaded machine


def chromium_path() -> str:
    """$GPULLAMA_CHROMIUM, else Debian's chromium (or Chrome) on PATH; a clear failure when there is none."""
    found = os.environ.get("GPULLAMA_CHROMIUM") or next(
        (path for name in ("chromium", "chromium-browser", "google-chrome") if (path := shutil.which(name))), None)
    if not found:
        pytest.fail("the chat page's browser tests need Chromium: run scripts/install-chromium (as root it installs "
                    "Debian's chromium with apt-get; `make test` runs it), or set GPULLAMA_CHROMIUM")
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


def new_context(browser, server, **options):
    """A fresh browser profile (empty IndexedDB and localStorage) whose requests outside the server's origin are
    refused and listed in ``context.outside``."""
    context = browser.new_context(**{"viewport": {"width": 1280, "height": 800}, **options})
    context.set_default_timeout(TIMEOUT_MS)
    context.outside = []

    def outside(route) -> None:
        context.outside.append(route.request.url)
        route.abort()

    origin = server.base_url
    context.route(lambda url: not (url == origin or url.startswith(origin + "/")), outside)
    return context


@pytest.fixture
def context(browser, server) -> Iterator:
    """A fresh profile for one test; at its end, no page in it asked anything of another origin."""
    context = new_context(browser, server, accept_downloads=True)
    yield context
    context.close()
    assert context.outside == [], f"the page made requests outside its origin: {context.outside}"


def open_page(context, server, settings: str | None = SHORT, key: bool = True, path: str = "/"):
    """The page, with the API key and `settings` stored as the settings dialog stores them (before the first
    load only), once its script has started."""
    if key or settings:
        context.add_init_script(f"""
            if (!sessionStorage.getItem("seeded")) {{
              sessionStorage.setItem("seeded", "1");
              {f'localStorage.setItem("gpullama.apiKey", {json.dumps(json.dumps(API_KEY))});' if key else ""}
              {f'localStorage.setItem("gpullama.settings", {json.dumps(settings)});' if settings else ""}
            }}""")
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.errors = errors
    page.goto(server.base_url + path)
    page.wait_for_selector("html[data-ready=true]")
    return page


def wait_for_model(page) -> None:
    page.wait_for_function("() => document.getElementById('model-meta').textContent.includes('context')")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_answer_done(page, index: int = -1):
    """The `index`-th answer once it has finished (its foot shows timings or a note, or an error)."""
    answer = page.locator(".message.assistant").nth(index)
    page.wait_for_function("""el => !el.classList.contains('streaming') && (
        el.querySelector('.timings').textContent || !el.querySelector('.message-error').hidden)""",
                           arg=answer.element_handle())
    return answer


def test_a_question_is_answered_in_streamed_text_with_timings(context, server) -> None:
    # an answer of 40 tokens spans several of the page's animation frames (it draws streamed text once a frame; a
    # short answer that arrives whole within one frame is drawn once, finished, on a fast machine)
    page = open_page(context, server, settings=json.dumps({"temperature": "0", "max_tokens": "40"}), key=False)
    # no key stored: the page asks for the one this server was started with
    page.wait_for_selector("#settings[open]")
    assert "API key" in page.text_content("#settings-error")
    page.fill("#api-key", API_KEY)
    page.click("#settings-save")
    wait_for_model(page)
    assert page.text_content("#model-name") == httpx.get(f"{server.base_url}/props",
                                                          headers={"authorization": f"Bearer {API_KEY}"}).json()[
        "model_alias"]
    assert "8,192 tokens" in page.text_content("#model-meta")
    assert page.is_hidden("#model-select")  # one model: no selector
    send(page, "Write a long story about a dragon.")
    # text shows while the answer is still streaming (the Stop button is up), then the timings
    page.wait_for_function("""() => {
        const el = document.querySelector('.message.assistant.streaming .message-body');
        return el && el.textContent.trim().length > 0 && el.textContent.trim() !== '…'
            && !document.getElementById('stop').hidden; }""")
    answer = wait_answer_done(page)
    text = answer.locator(".message-body").inner_text()
    assert len(text.strip()) > 3 and answer.locator(".message-error").is_hidden()
    timings = answer.locator(".timings").text_content()
    assert re.fullmatch(r"\d+ tokens · [\d.]+ tokens/s · first token [\d.]+ s( · Cut at the token limit\.)?", timings), \
        timings
    assert page.is_hidden("#stop") and page.is_visible("#send")
    assert page.locator(".message.user .user-text").text_content() == "Write a long story about a dragon."
    assert page.locator("#conversations li").count() == 1
    assert not page.errors


def test_stop_ends_the_stream_and_keeps_what_came(context, server) -> None:
    page = open_page(context, server, settings=json.dumps({"temperature": "0", "max_tokens": "2000"}))
    wait_for_model(page)
    aborted_before = server.log().count("finish aborted")
    send(page, "Write a long story about a dragon.")
    page.wait_for_function("""() => {
        const el = document.querySelector('.message.assistant.streaming .message-body');
        return el && el.textContent.trim().length > 10; }""")
    page.click("#stop")
    answer = wait_answer_done(page)
    assert "Stopped." in answer.locator(".timings").text_content()
    assert len(answer.locator(".message-body").inner_text()) > 10
    assert page.is_visible("#send") and page.is_hidden("#stop")
    # the server saw the client leave and aborted the generation
    deadline = time.monotonic() + 60
    while server.log().count("finish aborted") == aborted_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.log().count("finish aborted") > aborted_before


def test_a_reload_finds_the_conversation(context, server) -> None:
    page = open_page(context, server)
    wait_for_model(page)
    send(page, "Say hello.")
    first = wait_answer_done(page).locator(".message-body").inner_text()
    page.reload()
    page.wait_for_selector("html[data-ready=true]")
    assert page.locator(".message").count() == 2  # the open conversation comes back (its id in the URL)
    assert page.locator(".message.assistant .message-body").inner_text() == first
    fresh = context.new_page()  # a new tab on the bare address: the conversation is in the list
    fresh.goto(server.base_url + "/")
    fresh.wait_for_selector("html[data-ready=true]")
    assert fresh.locator(".message").count() == 0
    fresh.click("#conversations li button[data-action=open]")
    assert fresh.locator(".message.user .user-text").text_content() == "Say hello."
    assert fresh.locator(".message.assistant .message-body").inner_text() == first


def test_the_settings_reach_the_request_and_presets_keep_them(context, server) -> None:
    page = open_page(context, server, settings=None)
    wait_for_model(page)
    page.click("#open-settings")
    page.fill("#system", "You answer in one word.")
    page.fill("#temperature", "0.3")
    page.fill("#top_k", "5")
    page.fill("#seed", "7")
    page.fill("#max_tokens", "3")
    page.fill("#custom", '{"stop": ["zzz"]}')
    page.fill("#preset-name", "terse")
    page.click("#preset-save")
    page.click("#settings-save")
    with page.expect_request("**/v1/chat/completions") as caught:
        send(page, "Name a color.")
    body = caught.value.post_data_json
    assert body["temperature"] == 0.3 and body["top_k"] == 5 and body["seed"] == 7 and body["max_tokens"] == 3
    assert body["stop"] == ["zzz"] and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "system", "content": "You answer in one word."},
                                {"role": "user", "content": "Name a color."}]
    assert caught.value.headers["authorization"] == f"Bearer {API_KEY}"
    wait_answer_done(page)
    # a preset brings the values back after a reset
    page.click("#open-settings")
    page.click("#settings-reset")
    assert page.input_value("#temperature") == ""
    page.select_option("#preset", "terse")
    page.click("#preset-load")
    assert page.input_value("#temperature") == "0.3" and page.input_value("#system") == "You answer in one word."
    page.click("#settings-cancel")


def test_the_servers_refusals_are_shown_in_its_words(context, server, http) -> None:
    page = open_page(context, server, settings=json.dumps({"temperature": "-1"}))
    wait_for_model(page)
    send(page, "Hello")
    answer = wait_answer_done(page)
    expected = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello"}],
                                                       "temperature": -1}).json()["error"]["message"]
    error = answer.locator(".message-error").text_content()
    assert "(400)" in error and expected in error
    # a conversation longer than the context: the page says the context is full
    page.click("#open-settings")
    page.fill("#temperature", "0")
    page.click("#settings-save")
    page.click("#new-chat")
    send(page, "hello " * 9000)
    answer = wait_answer_done(page)
    error = answer.locator(".message-error").text_content()
    assert "does not fit the model's context" in error and "8192" in error


MARKDOWN_ANSWER = """Here is **bold** text and a table:

| a | b |
|---|---|
| 1 | 2 |

```python
def add(a, b):
    return a + b
```

<img src="x" onerror="window.__xss = 1"><script>window.__xss = 2</script>
![far](http://198.51.100.7/pixel.png)
"""


def _conversation(n_messages: int = 2, title: str = "Imported markdown") -> dict:
    messages = []
    for i in range(n_messages // 2):
        messages.append({"role": "user", "content": f"Question {i}: show me some Markdown"})
        messages.append({"role": "assistant", "content": MARKDOWN_ANSWER.replace("bold", f"bold {i}")})
    return {"format": "gpullama.conversations", "version": 1,
            "conversations": [{"title": title, "created": 1, "updated": 2, "messages": messages}]}


def test_import_renders_markdown_safely_and_export_gives_it_back(context, server, tmp_path: Path) -> None:
    page = open_page(context, server)
    source = tmp_path / "in.json"
    source.write_text(json.dumps(_conversation()))
    page.set_input_files("#import-file", str(source))
    page.wait_for_selector(".message.assistant")
    body = page.locator(".message.assistant .message-body")
    assert body.locator("strong").text_content() == "bold 0" and body.locator("table td").count() == 2
    assert body.locator(".code-block .hljs-keyword").first.text_content() == "def"
    assert body.locator(".code-head").text_content().startswith("python")
    assert body.locator("script").count() == 0 and page.evaluate("window.__xss") is None
    assert body.locator("a", has_text="far").count() == 1  # an image from elsewhere becomes a link, never loaded
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.base_url)
    body.locator("button[data-action=copy-code]").click()
    page.wait_for_function("async () => (await navigator.clipboard.readText()) === "
                           "'def add(a, b):\\n    return a + b'")
    with page.expect_download() as download:
        page.click("#export-chat")
    exported = json.loads(Path(download.value.path()).read_text())
    assert exported["format"] == "gpullama.conversations"
    [conversation] = exported["conversations"]
    assert conversation["title"] == "Imported markdown"
    assert [(m["role"], m["content"]) for m in conversation["messages"]] == [
        (m["role"], m["content"]) for m in _conversation()["conversations"][0]["messages"]]
    # re-imported: a second, separate conversation; rename, search and delete in the list
    again = tmp_path / "again.json"
    again.write_text(json.dumps(exported))
    page.set_input_files("#import-file", str(again))
    page.wait_for_function("() => document.querySelectorAll('#conversations li').length === 2")
    page.locator("#conversations li.current button[data-action=rename]").click()
    page.fill("#conversations input.rename", "Renamed")
    page.press("#conversations input.rename", "Enter")
    page.wait_for_selector("#conversations li.current >> text=Renamed")
    page.fill("#search", "renamed")
    assert page.locator("#conversations li[data-id]").count() == 1
    page.fill("#search", "")
    delete = page.locator("#conversations li.current button[data-action=delete]")
    delete.click()
    delete.click()  # the second press confirms
    page.wait_for_function("() => document.querySelectorAll('#conversations li[data-id]').length === 1")
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": [{"role": "wizard", "content": "x"}]}')
    page.set_input_files("#import-file", str(bad))
    page.wait_for_selector("#notice:not([hidden])")
    assert "role" in page.text_content("#notice")
    assert not page.errors


def test_continue_regenerate_and_edit(context, server) -> None:
    page = open_page(context, server, settings=json.dumps({"temperature": "0", "max_tokens": "3"}))
    wait_for_model(page)
    send(page, "Count from one to twenty in words.")
    answer = wait_answer_done(page)
    assert "Cut at the token limit" in answer.locator(".timings").text_content()
    cut = answer.locator(".message-body").inner_text()
    answer.locator("button[data-action=continue]").click()
    answer = wait_answer_done(page)
    longer = answer.locator(".message-body").inner_text()
    assert len(longer) > len(cut) and longer.startswith(cut.strip()[:5])
    answer.locator("button[data-action=regenerate]").click()
    answer = wait_answer_done(page)
    assert answer.locator(".message-body").inner_text() == cut  # temperature 0: the same first 3 tokens
    page.locator(".message.user button[data-action=edit]").click()
    page.fill(".message.user textarea.edit-area", "Name three fruits.")
    page.locator(".message.user button[data-action=edit-save]").click()
    answer = wait_answer_done(page)
    assert page.locator(".message").count() == 2
    assert page.locator(".message.user .user-text").text_content() == "Name three fruits."
    assert answer.locator(".message-body").inner_text() != cut


def test_phone_width_enter_breaks_the_line_and_the_list_is_a_drawer(browser, server) -> None:
    context = new_context(browser, server, viewport={"width": 375, "height": 740}, is_mobile=True, has_touch=True)
    try:
        page = open_page(context, server)
        wait_for_model(page)
        assert not page.is_visible("#sidebar") and page.is_visible("#open-sidebar")
        page.fill("#prompt", "first line")
        page.press("#prompt", "Enter")
        page.type("#prompt", "second line")
        assert page.input_value("#prompt") == "first line\nsecond line" and page.locator(".message").count() == 0
        page.click("#send")
        wait_answer_done(page)
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 375, f"the page scrolls sideways ({width} px)"
        page.click("#open-sidebar")
        page.wait_for_selector("#sidebar", state="visible")
        assert page.locator("#conversations li").count() == 1
        page.click("#close-sidebar")
        page.wait_for_selector("#sidebar", state="hidden")
    finally:
        context.close()
    assert context.outside == []


def test_a_500_message_conversation_stays_responsive(context, server, tmp_path: Path) -> None:
    page = open_page(context, server)
    source = tmp_path / "long.json"
    source.write_text(json.dumps(_conversation(500, "Long")))
    page.set_input_files("#import-file", str(source))
    page.wait_for_function("() => document.querySelectorAll('.message').length === 500")
    page.click("#new-chat")
    started = time.monotonic()
    page.click("#conversations li button[data-action=open]")
    page.wait_for_function("() => document.querySelectorAll('.message').length === 500")
    opened = time.monotonic() - started
    # typing is not held up by the long list: each key's handling takes little time in the page
    page.focus("#prompt")
    started = time.monotonic()
    page.keyboard.type("still quick")
    typed = time.monotonic() - started
    assert page.input_value("#prompt") == "still quick"
    assert opened < 10 and typed < 5, (opened, typed)
    page.wait_for_function("""() => { const m = document.getElementById('messages');
        return m.scrollHeight - m.scrollTop - m.clientHeight < 5; }""", timeout=5000)  # at the latest message


def test_the_page_works_below_a_proxys_path_prefix(context, server) -> None:
    """A proxy that serves the server at /chat-proxy/ and strips the prefix: every link and fetch of the page is
    relative, so it loads, reads the model and answers below the prefix."""
    prefix = f"{server.base_url}/chat-proxy"

    def proxy(route) -> None:
        url = route.request.url
        route.continue_(url=server.base_url + url[len(prefix):])

    context.route(f"{prefix}/**", proxy)
    page = open_page(context, server, path="/chat-proxy/")
    wait_for_model(page)
    send(page, "Hi")
    wait_answer_done(page)
    assert page.locator(".message.assistant .message-error").is_hidden()


def test_the_policy_blocks_the_page_from_reaching_elsewhere_and_the_guard_sees_what_gets_out(browser, server) -> None:
    """The checks above mean something: the page's own policy stops a fetch to another origin before it is sent,
    and a request that does go out (a navigation, which the policy does not govern) is caught by the guard."""
    context = new_context(browser, server)
    try:
        page = open_page(context, server)
        blocked = page.evaluate("""async () => {
            const seen = new Promise((ok) => document.addEventListener('securitypolicyviolation',
                (event) => ok(event.violatedDirective), { once: true }));
            try { await fetch('http://198.51.100.7/x'); return 'fetched'; } catch { return await seen; } }""")
        assert blocked == "connect-src"
        assert context.outside == []
        with pytest.raises(Exception, match="ERR_FAILED"):
            page.goto("http://198.51.100.7/elsewhere")
        assert context.outside == ["http://198.51.100.7/elsewhere"]
    finally:
        context.close()


@pytest.fixture(scope="module")
def two_models(tiny_model, tmp_path_factory: pytest.TempPathFactory):
    """A server of two tiny random llamas, tiny-a (the default, loaded at start) and tiny-b (loaded on demand)."""
    srv = start_server(None, tmp_path_factory.mktemp("webui-two") / "server.log",
                       ["--model", f"tiny-a={tiny_model('llama', seed=0).path}",
                        "--model", f"tiny-b={tiny_model('llama', seed=1).path}", "--log-stats-interval", "0"])
    yield srv
    stop_server(srv)


def test_the_model_selector_lists_the_models_and_asks_the_chosen_one(browser, two_models, tmp_path: Path) -> None:
    """On a server of several models the page lists them from /v1/models with their state; the one chosen is the
    request's `model`, and the answer is that model's (its own API's answer to the same body, not the other's)."""
    context = new_context(browser, two_models, accept_downloads=True)
    try:
        page = open_page(context, two_models, settings=json.dumps({"temperature": "0", "max_tokens": "8"}))
        wait_for_model(page)
        page.wait_for_function("() => document.getElementById('model-select').options.length === 2")
        select = page.locator("#model-select")
        assert select.is_visible() and page.is_hidden("#model-name")
        assert select.locator("option").all_text_contents() == ["tiny-a (loaded)", "tiny-b (unloaded)"]
        assert select.input_value() == "tiny-a"
        asked: list[dict] = []
        page.on("request", lambda r: asked.append(r.post_data_json) if r.url.endswith("/v1/chat/completions")
                else None)
        select.select_option("tiny-b")
        page.wait_for_function("() => document.getElementById('model-select').options[1].textContent"
                               " === 'tiny-b (loaded)'")  # choosing it loaded it
        wait_for_model(page)
        send(page, "Hi")
        answer = wait_answer_done(page)
        assert answer.locator(".message-error").is_hidden()
        [body] = asked
        assert body["model"] == "tiny-b"
        with page.expect_download() as download:
            page.click("#export-chat")
        shown = json.loads(Path(download.value.path()).read_text())["conversations"][0]["messages"][-1]["content"]
        replies = {}
        for name in ("tiny-a", "tiny-b"):
            reply = httpx.post(f"{two_models.base_url}/v1/chat/completions", timeout=300,
                               headers={"authorization": f"Bearer {API_KEY}"},
                               json={**{k: v for k, v in body.items() if not k.startswith("stream")}, "model": name})
            assert reply.status_code == 200, reply.text
            replies[name] = reply.json()["choices"][0]["message"]["content"]
        assert shown == replies["tiny-b"] != replies["tiny-a"]
        page.reload()  # the choice is kept
        page.wait_for_selector("html[data-ready=true]")
        page.wait_for_function("() => document.getElementById('model-select').value === 'tiny-b'")
        assert not page.errors
    finally:
        context.close()
    assert context.outside == []
