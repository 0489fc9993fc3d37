"""Hub ids (`--model org/name[@revision]`) through the real loading code and the real
huggingface_hub client, against a hub-shaped HTTP server on loopback that each test starts
(`LoopbackHub`, pointed at by HF_ENDPOINT): the model info and tree APIs `snapshot_download`
lists a revision with, and `/{repo}/resolve/{revision}/{file}` with the headers it checks.
No test reaches the internet."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from engine.build import CheckpointConfig, open_checkpoint
from engine.checkpoints.hub import (
    ALLOW_PATTERNS,
    IGNORE_PATTERNS,
    HubError,
    HubId,
    locate,
    parse_hub_id,
)
from engine.model import CheckpointError
from server.cli import main
from tests.server.conftest import start_server

REPO = "org/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Files a real repo carries besides the checkpoint, none of which serving reads.
EXTRAS = {
    "pytorch_model.bin": b"pickled weights",
    "model.gguf": b"GGUF",
    "original/model.safetensors": b"the original release's weights",
    "onnx/model.onnx": b"onnx",
    "README.md": b"# tiny",
}


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = COMMIT
    token: str | None = None  # gated: only this bearer token may read it


@dataclass
class LoopbackHub:
    """A hub on 127.0.0.1: serves `repos`, records every request as (method, path, headers
    by lower-case name), and can drop the connection halfway through a file's first download
    (`cut_once`) or send files shorter than it says they are (`short`)."""

    repos: dict[str, Repo]
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    cut_once: set[str] = field(default_factory=set)
    short: set[str] = field(default_factory=set)  # downloads of these send half the file
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def fetched(self) -> list[str]:
        """The repo files downloaded (GET), in order."""
        return [p.split("/", 5)[5] for m, p, _ in self.requests if m == "GET" and "/resolve/" in p]

    def start(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler(self))
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        """The network gone: nothing listens on the hub's port any more."""
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()


def handler(hub: LoopbackHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self.answer(body=False)

        def do_GET(self) -> None:
            self.answer(body=True)

        def reply(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
            self.send_response(status)
            for name, value in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(name, value)
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(body)

        def end_headers(self) -> None:
            # No keep-alive: once `stop` returns, no open connection can still reach the hub.
            self.send_header("Connection", "close")
            self.close_connection = True
            super().end_headers()

        def send_json(self, value: object) -> None:
            self.reply(200, {"Content-Type": "application/json"}, json.dumps(value).encode())

        def refuse(self, status: int, code: str) -> None:
            self.reply(status, {"X-Error-Code": code}, json.dumps({"error": code}).encode())

        def answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            headers = {name.lower(): value for name, value in self.headers.items()}
            hub.requests.append((self.command, path, headers))
            api = path.startswith("/api/models/")
            parts = path.removeprefix("/api/models/" if api else "/").split("/")
            if api and len(parts) == 2:  # the model info of the default branch
                parts += ["revision", "main"]
            repo = hub.repos.get("/".join(parts[:2]))
            if repo is None:
                return self.refuse(404, "RepoNotFound")
            if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                return self.refuse(401, "GatedRepo")
            kind, revision, name = parts[2], parts[3], "/".join(parts[4:])
            if revision not in ("main", repo.sha):
                return self.refuse(404, "RevisionNotFound")
            if api and kind == "revision":
                siblings = [{"rfilename": f} for f in repo.files]
                info = {"id": "/".join(parts[:2]), "sha": repo.sha, "siblings": siblings}
                return self.send_json(info)
            if api and kind == "tree":
                tree = [
                    {"type": "file", "path": f, "size": len(data), "oid": etag(data)}
                    for f, data in repo.files.items()
                ]
                return self.send_json(tree)
            if kind != "resolve" or name not in repo.files:
                return self.refuse(404, "EntryNotFound")
            self.send_file(repo, name, repo.files[name])

        def send_file(self, repo: Repo, name: str, data: bytes) -> None:
            headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{etag(data)}"'}
            start = int(self.headers.get("Range", "bytes=0-").removeprefix("bytes=").split("-")[0])
            if start:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            if self.command == "GET" and name in hub.cut_once:
                hub.cut_once.discard(name)
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])  # and the connection closes
                return
            if self.command == "GET" and name in hub.short:
                return self.reply(200, headers, data[: len(data) // 2])
            self.reply(206 if start else 200, headers, data[start:])

    return Handler


def etag(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()


@pytest.fixture
def hub(tiny_checkpoint, monkeypatch) -> Iterator[LoopbackHub]:
    """A loopback hub serving the tiny c16 checkpoint (and files serving never reads) as
    `org/tiny`, with huggingface_hub pointed at it: HF_ENDPOINT for anything started later,
    and the constants huggingface_hub read from it at import."""
    files = {p.name: p.read_bytes() for p in tiny_checkpoint("c16").iterdir() if p.is_file()}
    hub = LoopbackHub({REPO: Repo({**files, **EXTRAS})})
    hub.start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    template = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield hub
    if hub.server is not None and hub.server.socket.fileno() != -1:
        hub.stop()


def checkpoint_files(tiny_checkpoint) -> set[str]:
    return {p.name for p in tiny_checkpoint("c16").iterdir() if p.is_file()}


def test_a_hub_id_is_downloaded_served_and_served_again_from_the_cache_with_the_hub_gone(
    hub, tiny_checkpoint, tmp_path, caplog
):
    """The deployment's first and second start, each a whole server (the slowest test here:
    two model loads)."""
    cache = str(tmp_path / "cache")
    body = {"model": REPO, "prompt": "hi", "max_tokens": 4, "seed": 0}
    server, stop = start_server(REPO, "--download-dir", cache)
    try:
        models = httpx.get(f"{server.v1}/models").json()["data"]
        assert [m["id"] for m in models] == [REPO]  # the default served name: the hub id
        first = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
        assert first.status_code == 200, first.text
    finally:
        stop()
    # Only what serving reads, each file once: no .bin, .gguf, ONNX, README or original/.
    assert sorted(hub.fetched()) == sorted(checkpoint_files(tiny_checkpoint))
    hub.stop()
    num_requests = len(hub.requests)
    with caplog.at_level(logging.WARNING, logger="engine.checkpoints.hub"):
        server, stop = start_server(REPO, "--download-dir", cache)
    try:
        again = httpx.post(f"{server.v1}/completions", json=body, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    finally:
        stop()
    assert len(hub.requests) == num_requests
    assert "cannot be reached" in caplog.text and "serving the cached snapshot" in caplog.text


def test_offline_mode_serves_the_cache_without_asking_the_hub(hub, tmp_path, monkeypatch, caplog):
    first, name = locate(REPO, tmp_path)
    assert name == REPO and (first / "model.safetensors").is_file()
    num_requests = len(hub.requests)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1 at start-up
    with caplog.at_level(logging.WARNING, logger="engine.checkpoints.hub"):
        again = open_checkpoint(CheckpointConfig(REPO, device="cpu", download_dir=tmp_path))
    assert again.model_dir == first and again.name == REPO
    assert len(hub.requests) == num_requests
    assert "HF_HUB_OFFLINE" in caplog.text and "serving the cached snapshot" in caplog.text


def test_a_second_start_online_downloads_nothing_again(hub, tmp_path):
    first, _ = locate(REPO, tmp_path)
    num_fetched = len(hub.fetched())
    again, _ = locate(REPO, tmp_path)
    assert again == first and len(hub.fetched()) == num_fetched


def test_a_failed_download_is_a_one_line_error_and_the_next_start_completes_it(hub, tmp_path):
    hub.short.add("model.safetensors")  # a file that arrives shorter than the hub said
    with pytest.raises(HubError, match=f"model {REPO}: the download into .* failed") as error:
        locate(REPO, tmp_path)
    assert str(error.value).endswith("start again to resume it")
    hub.short.clear()
    path, _ = locate(REPO, tmp_path)
    assert (path / "model.safetensors").is_file()


def test_generate_takes_a_hub_id(hub, tmp_path, capsys):
    """The whole command (a model load): it also reads the downloaded directory itself."""
    argv = ["generate", "--model", REPO, "--download-dir", str(tmp_path), "--prompt", "hi"]
    assert main([*argv, "--max-tokens", "4", "--seed", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["finish_reason"] in ("stop", "length")
    assert "config.json" in hub.fetched()


def test_convert_takes_a_hub_id_as_its_source(hub, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["convert", "--from", REPO, "--to", str(out), "--download-dir", str(tmp_path)]
    assert main(argv) == 2  # downloaded and read: a block-diffusion model is no AR source
    err = capsys.readouterr().err
    assert "canvas convert: error: " in err and "not a .gguf file" not in err  # a directory
    assert {"config.json", "model.safetensors"} <= set(hub.fetched())


@pytest.mark.parametrize(
    ("model", "offline", "fragment"),
    [
        ("org/missing", False, "model org/missing: no such model on the hub, and no such local"),
        (f"{REPO}@v9", False, f"model {REPO}@v9: no revision 'v9'"),
        (REPO, True, f"model {REPO}: offline (HF_HUB_OFFLINE is set), and the download cache"),
        ("no-such-dir", False, "no-such-dir: no such directory (config.json not found), and not"),
    ],
    ids=["unknown-repo", "bad-revision", "offline-not-cached", "neither-path-nor-hub-id"],
)
def test_a_model_that_cannot_be_had_is_a_one_line_start_up_error_naming_it(
    model, offline, fragment, hub, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    argv = ["serve", "--model", model, "--download-dir", str(tmp_path), "--port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("canvas serve: error: ") and fragment in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_hub_gone_and_nothing_cached_names_the_model_and_the_way_out(hub, tmp_path):
    hub.stop()
    with pytest.raises(HubError, match="cannot be reached") as error:
        locate(REPO, tmp_path)
    assert f"model {REPO}" in str(error.value) and "--download-dir" in str(error.value)


def test_a_gated_repo_needs_hf_token_which_is_sent_as_a_bearer_token(hub, tmp_path, monkeypatch):
    hub.repos[REPO].token = "hf_sekrit"
    with pytest.raises(HubError, match=f"model {REPO}: gated: .* set HF_TOKEN"):
        locate(REPO, tmp_path)
    num_refused = len(hub.requests)
    monkeypatch.setenv("HF_TOKEN", "hf_sekrit")
    path, _ = locate(REPO, tmp_path)
    assert (path / "config.json").is_file()
    sent = [headers.get("authorization") for _, _, headers in hub.requests[num_refused:]]
    assert sent and set(sent) == {"Bearer hf_sekrit"}


def test_a_cut_download_is_resumed_where_it_stopped(hub, tiny_checkpoint, tmp_path, monkeypatch):
    # huggingface_hub writes whole chunks (10 MB by default): a smaller one lets the tiny
    # file's first half reach the disk before the connection drops.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 1 << 16)
    hub.cut_once.add("model.safetensors")
    path, _ = locate(REPO, tmp_path)
    weights = (tiny_checkpoint("c16") / "model.safetensors").read_bytes()
    assert (path / "model.safetensors").read_bytes() == weights
    ranges = [h.get("range") for m, p, h in hub.requests if p.endswith("/model.safetensors")]
    resumed_at = int(ranges[-1].removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= len(weights) // 2  # the whole chunks that arrived were kept


def test_a_pinned_revision_is_downloaded_and_named_without_it(hub, tmp_path):
    path, name = locate(f"{REPO}@{COMMIT}", tmp_path)
    assert name == REPO and path.name == COMMIT


def test_an_existing_directory_wins_over_the_hub_id_shape(
    hub, tiny_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / REPO).symlink_to(tiny_checkpoint("c16"))
    path, name = locate(REPO)
    assert path == Path(REPO) and name == "tiny"
    assert hub.requests == []


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("google/diffusiongemma-26B-A4B-it", HubId("google/diffusiongemma-26B-A4B-it")),
        ("org/name@v1.0", HubId("org/name", "v1.0")),
        ("org/name@refs/pr/4", HubId("org/name", "refs/pr/4")),
        ("org/name", HubId("org/name")),
        ("./org/name", None),
        ("../models", None),
        ("/models/x", None),
        ("name", None),
        ("org/name/extra", None),
        ("org/name@", None),
        ("org/na--me", None),
        ("org/name.git", None),
        ("org/name-", None),
    ],
)
def test_hub_ids_are_org_slash_name_with_an_optional_revision(text, parsed):
    assert parse_hub_id(text) == parsed


def test_the_download_filter_keeps_what_serving_reads_and_the_adapter_folder_only():
    listed = [
        *("config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json"),
        *("tokenizer.json", "chat_template.jinja", "processor_config.json"),
        *("adapter/adapter.safetensors", "adapter/adapter_config.json"),
        *("original/model.safetensors", "adapters/x.safetensors", "ad/x.safetensors"),
        *("a/config.json.safetensors", "adapterx/y.safetensors", "deep/adapter/x.safetensors"),
        *("pytorch_model.bin", "model.gguf", "onnx/model.onnx", "consolidated.pt"),
    ]
    kept = filter_repo_objects(
        listed, allow_patterns=list(ALLOW_PATTERNS), ignore_patterns=list(IGNORE_PATTERNS)
    )
    assert list(kept) == listed[:8]


def test_a_missing_path_is_still_the_checkpoint_error_it_was():
    with pytest.raises(CheckpointError, match="config.json not found"):
        locate("/nonexistent")
