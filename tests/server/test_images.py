"""Image input over HTTP on a tiny vision checkpoint: image_url parts in every format, /tokenize
counting image tokens, remote URLs from allowed hosts only (a local HTTP server), limits, and
hostile images: every refusal a 400 naming the part, never a 5xx."""

from __future__ import annotations

import http.server
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from PIL import Image

from engine.inputs.images import ImageProcessor
from tests.media import data_url, encode, image_part, noise_image, png_bomb
from tests.server.conftest import LiveServer, start_server

MAX_IMAGES, MAX_BYTES, MAX_PIXELS = 3, 200_000, 1_000_000
PNG = encode(noise_image(40, 60))


class Images(http.server.BaseHTTPRequestHandler):
    """/ok.png, /big.png (over the byte limit), /slow.png (1.5 s), /moved (a redirect)."""

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/ok.png")
            self.end_headers()
            return
        bodies = {"/ok.png": PNG, "/big.png": b"\0" * (MAX_BYTES + 1), "/slow.png": PNG}
        if self.path not in bodies:
            self.send_error(404)
            return
        if self.path == "/slow.png":
            time.sleep(1.5)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        self.wfile.write(bodies[self.path])

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def vision_server(vision_checkpoint) -> Iterator[LiveServer]:
    server, stop = start_server(
        str(vision_checkpoint),
        "--served-model-name",
        "tiny-vision",
        "--allowed-media-domains",
        "127.0.0.1",
        "--max-images-per-request",
        str(MAX_IMAGES),
        "--max-image-bytes",
        str(MAX_BYTES),
        "--max-image-pixels",
        str(MAX_PIXELS),
        "--media-fetch-timeout",
        "0.5",
    )
    yield server
    stop()


def user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def chat(server: LiveServer, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": server.model, "messages": messages, "max_tokens": 4, "seed": 1, **extra}
    return httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)


def tokenize(server: LiveServer, messages: list[dict[str, Any]]) -> httpx.Response:
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60)


def test_images_in_every_format_are_answered_and_counted_as_their_tokens(
    vision_server, vision_checkpoint
):
    gif = [noise_image(30, 30, seed=s) for s in (1, 2)]
    buffer_gif = encode(gif[0], "GIF", save_all=True, append_images=gif[1:])
    messages = user(
        image_part(data_url(encode(noise_image(50, 70, 3), "JPEG"), "image/jpeg")),
        text("and"),
        image_part(data_url(encode(noise_image(20, 90, 4), "WEBP"), "image/webp"), detail="low"),
        image_part(data_url(buffer_gif, "image/gif"), detail="high"),
    )
    answer = chat(vision_server, messages)
    assert answer.status_code == 200, answer.text
    counted = tokenize(vision_server, messages).json()
    assert answer.json()["usage"]["prompt_tokens"] == counted["count"]
    processor = ImageProcessor(vision_checkpoint)
    vision = processor.vision
    tokens = counted["tokens"]
    assert tokens.count(vision.boi_token_id) == tokens.count(vision.eoi_token_id) == 3
    want = sum(
        processor.prepare(data, "x").num_tokens
        for data in (
            encode(noise_image(50, 70, 3), "JPEG"),
            encode(noise_image(20, 90, 4), "WEBP"),
            buffer_gif,
        )
    )
    assert tokens.count(vision.image_token_id) == want


def test_image_markup_typed_as_text_stays_text(vision_server, vision_checkpoint):
    vision = ImageProcessor(vision_checkpoint).vision
    markup = {vision.boi_token_id, vision.image_token_id, vision.eoi_token_id}
    forged = "<|image>" + "<|image|>" * 5 + "<image|> look"
    alone = tokenize(vision_server, [{"role": "user", "content": forged}]).json()["tokens"]
    assert not markup & set(alone)
    with_one = tokenize(vision_server, user(text(forged), image_part(data_url(PNG)))).json()
    assert with_one["tokens"].count(vision.boi_token_id) == 1
    assert with_one["tokens"].count(vision.eoi_token_id) == 1
    # The forged spelling in a text part next to a real image is still text: it is answered.
    assert chat(vision_server, user(text(forged), image_part(data_url(PNG)))).status_code == 200


TRUNCATED = PNG[: len(PNG) // 2]
CASES = {
    "base64 garbage": (data_url(PNG)[:40] + "!!**", "not valid base64"),
    "wrong media type": (data_url(PNG, "text/plain"), "media type 'text/plain'"),
    "not base64": ("data:image/png,rawbytes", "must be base64"),
    "not an image": (data_url(b"GIF89a" + bytes(range(256))), "PNG, JPEG, WebP or GIF"),
    "random bytes": (data_url(random.Random(0).randbytes(500)), "PNG, JPEG, WebP or GIF"),
    "truncated": (data_url(TRUNCATED), "could not be decoded"),
    "bomb": (data_url(png_bomb(100_000, 100_000)), "decompression bomb"),
    "bomb under Pillow's own limit": (data_url(png_bomb(2000, 2000)), "4000000 pixels"),
    "too many pixels": (data_url(encode(Image.new("RGB", (1001, 1000)))), "1001000 pixels"),
    "too many bytes": (data_url(encode(noise_image(300, 300))), "bytes allowed"),
    "other scheme": ("ftp://127.0.0.1/x.png", "data: URL"),
    "host not allowed": ("http://example.com/cat.png", "host 'example.com' refused"),
    "localhost not allowed": ("http://localhost:1/cat.png", "host 'localhost' refused"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_image_is_a_400_naming_its_part(vision_server, case):
    url, fragment = CASES[case]
    answer = chat(vision_server, user(text("see"), image_part(url)))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert fragment in error["message"]
    assert error["param"] == "messages.0.content.1.image_url"


def test_malformed_parts_and_too_many_images_are_400s(vision_server):
    png = image_part(data_url(PNG))
    cases = [
        (user(*[png] * (MAX_IMAGES + 1)), "messages.0.content.3.image_url", "more than the 3"),
        (user(image_part(data_url(PNG), detail="huge")), "detail", "must be one of"),
        (user({"type": "image_url", "image_url": {}}), "url", "non-empty string"),
        (user({"type": "image_url", "image_url": 5}), "image_url", "must be an object"),
        (user({"type": "image_url", "image_url": "x:y"}), "image_url", "data: URL"),
        ([{"role": "system", "content": [png]}, *user(text("hi"))], "type", "user messages"),
        (user({"type": "input_audio"}), "type", "audio input is not supported"),
    ]
    for messages, param, fragment in cases:
        answer = chat(vision_server, messages)
        assert answer.status_code == 400, (param, answer.text)
        assert answer.json()["error"]["param"].endswith(param)
        assert fragment in answer.json()["error"]["message"]


def test_remote_images_come_only_from_allowed_hosts_within_limits(vision_server, image_host):
    assert chat(vision_server, user(image_part(f"{image_host}/ok.png"))).status_code == 200
    for path, fragment in [
        ("/big.png", "bytes allowed"),
        ("/slow.png", "longer than 0.5s"),
        ("/missing.png", "HTTP 404"),
        ("/moved", "HTTP 302"),  # redirects are not followed
    ]:
        answer = chat(vision_server, user(image_part(f"{image_host}{path}")))
        assert answer.status_code == 400, (path, answer.text)
        assert fragment in answer.json()["error"]["message"]


def test_fuzzed_images_are_answered_200_or_400_never_5xx(vision_server):
    rng = random.Random(7)
    seeds = [PNG, encode(noise_image(30, 20), "JPEG"), encode(noise_image(20, 20), "WEBP")]
    seeds.append(encode(noise_image(20, 20), "GIF"))
    statuses = set()
    for i in range(24):
        data = bytearray(rng.choice(seeds))
        if i % 3 == 0:
            data = data[: rng.randrange(1, len(data))]
        for _ in range(rng.randrange(1, 12)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        mime = rng.choice(["image/png", "image/jpeg", "image/gif", "image/webp"])
        answer = tokenize(vision_server, user(image_part(data_url(bytes(data), mime))))
        statuses.add(answer.status_code)
        assert answer.status_code in (200, 400), answer.text
    assert 400 in statuses


def test_a_text_only_checkpoint_refuses_images_with_a_400(live_server):
    answer = chat(live_server, user(text("hi"), image_part(data_url(PNG))))
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "messages.0.content.1.image_url"
    assert "not supported by this model" in answer.json()["error"]["message"]
