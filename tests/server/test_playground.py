"""The playground page and its files over the fake engine: served at / and /playground, public
even with an API key, locked down by its headers, and fed by `draft_tokens` in the stream.
The page in a real browser: tests/browser."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.server.conftest import make_fake_server
from tests.server.fake_engine import FakeEngine

STATIC = Path(__file__).parents[2] / "server" / "static"


@pytest.mark.parametrize("path", ["/", "/playground"])
def test_the_page_is_served_at_the_root_and_at_playground(fake, path):
    r = fake.client.get(path)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>Canvas playground</title>" in r.text
    assert r.text == (STATIC / "index.html").read_text()


@pytest.mark.parametrize(
    ("name", "media_type"),
    [("playground.js", "text/javascript"), ("playground.css", "text/css")],
)
def test_the_pages_assets_are_served_with_their_types(fake, name, media_type):
    r = fake.client.get(f"/playground/{name}")
    assert r.status_code == 200 and r.headers["content-type"].startswith(media_type)
    assert r.content == (STATIC / name).read_bytes()


def test_the_page_loads_only_what_it_links_and_nothing_from_elsewhere(fake):
    html = fake.client.get("/").text
    linked = re.findall(r'(?:src|href)="([^"#]+)"', html)
    assert sorted(linked) == ["/playground/playground.css", "/playground/playground.js", "data:,"]
    for path in linked:
        if path.startswith("/"):
            assert fake.client.get(path).status_code == 200
    csp = fake.client.get("/").headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert "default-src 'none'" in csp and "unsafe-inline" not in csp


def test_an_unknown_asset_is_a_404_in_the_openai_envelope(fake):
    for path in ["/playground/secret.py", "/playground/index.html", "/playground/..%2fapp.py"]:
        r = fake.client.get(path)
        assert r.status_code == 404, path
        assert r.json()["error"]["message"] == "Not found: no such route"


def test_the_page_is_public_when_the_api_routes_need_a_key():
    server = make_fake_server(api_keys=("sekrit",))
    with server.client:
        assert server.client.get("/").status_code == 200
        assert server.client.get("/playground/playground.js").status_code == 200
        assert server.client.get("/v1/models").status_code == 401
        assert "sekrit" not in server.client.get("/").text


def test_drafts_come_with_one_string_per_canvas_position():
    server = make_fake_server(FakeEngine(drafts_per_canvas=2))
    with server.client:
        chunks = server.sse("/completions", prompt="a", max_tokens=6, stream_drafts=True)
    drafts = [c["choices"][0] for c in chunks[:-1] if "draft" in c["choices"][0]]
    assert drafts  # a reader slower than the engine gets only the newest draft of a canvas
    for item in drafts:
        assert len(item["draft_tokens"]) == server.engine.limits.canvas_length
        assert "".join(item["draft_tokens"]) == item["draft"]
        assert set(item["draft_tokens"]) <= {"0", "1"}  # the fake's drafts: step digits


def test_no_draft_tokens_without_stream_drafts(fake):
    chunks = fake.sse("/completions", prompt="a", max_tokens=6)
    assert all("draft_tokens" not in c["choices"][0] for c in chunks[:-1] if c["choices"])
