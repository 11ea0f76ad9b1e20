"""The chat page's serving, without a model or a browser: ``GET /`` by Accept header, the hashed, gzip-compressed,
long-cached assets and their import graph, the Content-Security-Policy, ``--no-webui`` and ``--root-path``
(tests/server/test_webui_browser.py drives the page itself in Chromium)."""

from __future__ import annotations

import gzip
import re
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from gpullama.server.app import create_app
from gpullama.server.cli import parse_args
from gpullama.server.http.root_path import normalize_root_path
from gpullama.server.state import ServerConfig, ServerState
from gpullama.server.webui.serving import CONTENT_SECURITY_POLICY, STATIC, Bundle, bundle

BROWSER = {"accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
ASSET_BUDGET_GZIPPED = 160_000  # bytes on the wire for the whole page; it is about 100 KB today


def _client(**config) -> TestClient:
    """The app without its lifespan: no model loads (the page and its files need none)."""
    config = ServerConfig(**config)
    return TestClient(create_app(config, ServerState(config)), base_url="http://127.0.0.1:8080")


@pytest.fixture(scope="module")
def client() -> TestClient:
    return _client()


def _links(page: str) -> list[str]:
    return re.findall(r'(?:src|href)="(assets/[^"]+)"', page)


def test_a_browser_gets_the_page_and_every_other_client_the_probe_answer(client: TestClient) -> None:
    page = client.get("/", headers=BROWSER)
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert '<textarea id="prompt"' in page.text and page.headers["cache-control"] == "no-cache"
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert page.headers["x-content-type-options"] == "nosniff"
    for accept in (None, "*/*", "application/json"):  # Ollama's clients, curl, httpx
        probe = client.get("/", headers={"accept": accept} if accept else {})
        assert probe.text == "Ollama is running" and probe.headers["content-type"].startswith("text/plain")
    head = client.head("/", headers=BROWSER)
    assert head.status_code == 200 and head.content == b"" and head.headers["content-type"].startswith("text/html")
    assert client.head("/").status_code == 200


def test_the_policy_allows_nothing_from_elsewhere_and_no_inline_script() -> None:
    policy = dict(part.strip().split(" ", 1) for part in CONTENT_SECURITY_POLICY.split(";"))
    assert policy["default-src"] == "'none'"
    assert policy["script-src"] == policy["style-src"] == policy["connect-src"] == "'self'"
    assert "unsafe" not in CONTENT_SECURITY_POLICY and "http" not in CONTENT_SECURITY_POLICY
    page = (STATIC / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", page), "an inline script would be blocked by the policy"
    assert not re.search(r"\sstyle=|\son\w+=", page), "inline styles and handlers would be blocked by the policy"


def test_assets_have_hashed_names_long_cache_gzip_and_their_types(client: TestClient) -> None:
    links = _links(client.get("/", headers=BROWSER).text)
    assert {Path(link).suffix for link in links} == {".svg", ".css", ".js"}
    for link in {*links, *(f"assets/{name}" for name in bundle().assets)}:  # the page's links and its imports
        assert re.search(r"\.[0-9a-f]{12}\.\w+$", link), link
        zipped = client.get("/" + link, headers={"accept-encoding": "gzip"})
        assert zipped.status_code == 200, link
        assert zipped.headers["cache-control"] == "public, max-age=31536000, immutable"
        assert "accept-encoding" in zipped.headers["vary"]
        plain = client.get("/" + link, headers={"accept-encoding": "identity"})
        assert "content-encoding" not in plain.headers
        if link.endswith((".js", ".css")):
            assert zipped.headers["content-encoding"] == "gzip"
            assert int(zipped.headers["content-length"]) < len(plain.content) / 2
        assert zipped.content == plain.content  # httpx decodes the gzip
    assert client.get("/assets/app.js").status_code == 404  # only hashed names are served
    assert client.get("/assets/vendor/marked.LICENSE.txt").status_code == 404
    assert client.get("/assets/../state.py").status_code == 404


def test_every_module_import_points_at_a_served_hashed_file() -> None:
    served = bundle().assets
    imports = 0
    for name, asset in served.items():
        if not name.endswith(".js"):
            continue
        for specifier in re.findall(r"""\bfrom\s*["'](\.[^"']+)["']""", asset.body.decode()):
            target = str(Path(name).parent / specifier).removeprefix("./")
            target = str(Path(target))  # resolves "vendor/./x" and "a/../b"
            assert target in served, f"{name} imports {specifier}, which is not served"
            imports += 1
    assert imports >= 8


def test_the_page_is_small(client: TestClient) -> None:
    """Every file the page loads, as gzip sends them: a budget so that no dependency slips in unnoticed."""
    wire = sum(len(asset.gzipped) for asset in bundle().assets.values())
    assert wire < ASSET_BUDGET_GZIPPED, f"the page's files are {wire} bytes gzipped"


def test_a_changed_import_changes_the_importers_name(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text('<head><script type="module" src="assets/main.js"></script></head>')
    (tmp_path / "lib.js").write_text("export const x = 1;\n")
    (tmp_path / "main.js").write_text('import { x } from "./lib.js";\nconsole.log(x);\n')
    first = Bundle.load(tmp_path)
    (tmp_path / "lib.js").write_text("export const x = 2;\n")
    second = Bundle.load(tmp_path)
    main_1 = re.search(r"assets/(main\.\w+\.js)", first.page)[1]
    main_2 = re.search(r"assets/(main\.\w+\.js)", second.page)[1]
    assert main_1 != main_2, "main.js's name must change when a module it imports changes"
    assert re.search(rb'from "\./lib\.[0-9a-f]{12}\.js"', second.assets[main_2].body)
    (tmp_path / "main.js").write_text('import { y } from "./missing.js";\n')
    with pytest.raises(FileNotFoundError, match="missing.js"):
        Bundle.load(tmp_path)


def test_no_webui_tells_a_browser_where_the_api_is() -> None:
    client = _client(webui=False)
    answer = client.get("/", headers=BROWSER)
    assert answer.status_code == 200 and "--no-webui" in answer.text
    assert "/v1/chat/completions" in answer.text and "<textarea" not in answer.text
    assert client.get("/").text == "Ollama is running"
    link = _links(_client().get("/", headers=BROWSER).text)[-1]
    assert client.get("/" + link).status_code == 404


def test_root_path_serves_the_page_and_the_api_below_the_prefix_and_keeps_the_key_check() -> None:
    client = _client(root_path="/llm/chat", api_key="k")
    page = client.get("/llm/chat/", headers=BROWSER)
    assert page.status_code == 200 and '<base href="/llm/chat/">' in page.text
    link = _links(page.text)[-1]
    assert client.get("/llm/chat/" + link).status_code == 200  # the path as the browser asks for it
    assert client.get("/" + link).status_code == 200  # a proxy that strips the prefix
    assert client.get("/llm/chat", headers=BROWSER).status_code == 200
    # the key check sees the path below the prefix: no way around it
    for path in ("/llm/chat/v1/models", "/v1/models", "/llm/chat/props"):
        assert client.get(path).status_code == 401, path
    assert client.get("/llm/chat/v1/models", headers={"authorization": "Bearer k"}).status_code == 503  # loading
    assert client.get("/llm/chat/").text == "Ollama is running"
    unprefixed = _client(webui=False, root_path="/llm").get("/llm/", headers=BROWSER)
    assert "/llm/v1/chat/completions" in unprefixed.text
    assert '<base href' not in _client().get("/", headers=BROWSER).text


@pytest.mark.parametrize("given, prefix", [("", ""), ("/", ""), ("llm", "/llm"), ("/llm/", "/llm"),
                                           ("/a/b", "/a/b")])
def test_root_path_is_normalized(given: str, prefix: str) -> None:
    assert normalize_root_path(given) == prefix


def test_the_flags() -> None:
    args = parse_args([])
    assert args.webui is True and args.root_path == ""
    args = parse_args(["--no-webui", "--root-path", "llm/"])
    assert args.webui is False and args.root_path == "/llm"


def test_the_page_ships_with_its_vendored_licenses() -> None:
    vendor = STATIC / "vendor"
    for library in ("marked", "dompurify", "highlight"):
        assert (vendor / f"{library}.LICENSE.txt").is_file()
    assert not any("sourceMappingURL" in p.read_text() for p in vendor.glob("*.js"))


def test_gzip_is_deterministic() -> None:
    """The compressed bytes do not carry a time (mtime 0): the same files give the same answer."""
    asset = next(iter(bundle().assets.values()))
    assert gzip.decompress(asset.gzipped) == asset.body and asset.gzipped[4:8] == b"\0\0\0\0"
