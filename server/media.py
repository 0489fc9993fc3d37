"""Image parts of a chat request: where their bytes come from, and their preprocessing.

An `image_url` part's URL is a `data:` URL (`data:image/png;base64,...`: PNG, JPEG, WebP or
GIF), or an http(s) URL, fetched only when the operator allowed its host
(`--allowed-media-domains`: the host or a subdomain of it), without redirects or proxies,
within the per-image byte limit and `--media-fetch-timeout`. Everything a client controls is
bounded before work is done on it (images per request, bytes before base64 decoding, pixels
before decompressing: `engine.inputs.images`), and every refusal is a ParamError naming the part, so
the client gets a 400. Decoding and preprocessing run in a worker thread, never on the event
loop.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from engine.inputs.images import MIME_TYPES, ImageLimits
from engine.params import ParamError

if TYPE_CHECKING:  # loads transformers; the server only calls it
    from engine.inputs.images import ImageProcessor, PreparedImage

logger = logging.getLogger(__name__)
DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),", re.IGNORECASE)
WHITESPACE = re.compile(r"[ \t\r\n]")  # some clients wrap base64 lines


@dataclass(frozen=True, slots=True)
class ImageRef:
    """One image part: the parameter that names it and its URL."""

    param: str
    url: str


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """What the server accepts and fetches: the image limits, the hosts whose http(s) image
    URLs it fetches (none: data: URLs only), and a fetch's time limit."""

    limits: ImageLimits = field(default_factory=ImageLimits)
    allowed_domains: frozenset[str] = frozenset()
    fetch_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.fetch_timeout_s <= 0:
            raise ValueError("--media-fetch-timeout must be > 0")

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains)


class Media:
    """Image input of a vision checkpoint: its processor and the server's policy."""

    def __init__(self, processor: ImageProcessor, policy: MediaPolicy) -> None:
        self.processor = processor
        self.policy = policy

    async def prepare(self, refs: list[ImageRef]) -> list[PreparedImage]:
        """The images of a request's parts, in order; ParamError naming the part at fault."""
        limit = self.policy.limits.max_images
        if len(refs) > limit:
            message = f"{len(refs)} images in one request, more than the {limit} allowed"
            raise ParamError(refs[limit].param, message)
        payloads = [await self._bytes(ref) for ref in refs]
        return await asyncio.to_thread(
            lambda: [
                self.processor.prepare(data, ref.param)
                for ref, data in zip(refs, payloads, strict=True)
            ]
        )

    async def _bytes(self, ref: ImageRef) -> bytes:
        scheme = ref.url.split(":", 1)[0].lower()
        if scheme == "data":
            return decode_data_url(ref.url, ref.param, self.policy.limits.max_image_bytes)
        if scheme in ("http", "https"):
            return await self._fetch(ref)
        raise ParamError(ref.param, "must be a data: URL (base64) or an http(s) URL")

    async def _fetch(self, ref: ImageRef) -> bytes:
        import httpx

        host = urlsplit(ref.url).hostname or ""
        if not self.policy.allows(host):
            allowed = sorted(self.policy.allowed_domains)
            where = f"only from {', '.join(allowed)}" if allowed else "not at all"
            raise ParamError(
                ref.param,
                f"this server fetches remote images {where} (host {host!r} refused): send the "
                "image inline as a data: URL (data:image/png;base64,...)",
            )
        timeout = self.policy.fetch_timeout_s
        try:
            return await asyncio.wait_for(self._download(ref), timeout)
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11 on
            message = f"fetching the image took longer than {timeout:g}s"
            raise ParamError(ref.param, message) from None
        except httpx.HTTPError as exc:
            raise ParamError(
                ref.param, f"the image could not be fetched ({type(exc).__name__})"
            ) from None

    async def _download(self, ref: ImageRef) -> bytes:
        import httpx

        limit = self.policy.limits.max_image_bytes
        too_big = f"the image is more than the {limit} bytes allowed"
        timeout = httpx.Timeout(self.policy.fetch_timeout_s)
        async with (
            httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client,
            client.stream("GET", ref.url) as response,
        ):
            if response.status_code != 200:
                raise ParamError(
                    ref.param, f"fetching the image answered HTTP {response.status_code}"
                )
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise ParamError(ref.param, too_big)
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > limit:
                    raise ParamError(ref.param, too_big)
        return bytes(data)


def decode_data_url(url: str, param: str, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:` URL of an image type; ParamError naming `param`."""
    match = DATA_URL.match(url)
    if match is None:
        raise ParamError(param, "is not a data: URL (data:image/png;base64,...)")
    mime = match["mime"].strip().lower()
    if mime not in MIME_TYPES:
        raise ParamError(
            param, f"media type {mime or 'none'!r} is not supported; send PNG, JPEG, WebP or GIF"
        )
    if "base64" not in (p.strip().lower() for p in match["params"].split(";")):
        raise ParamError(param, "must be base64-encoded (data:image/png;base64,...)")
    payload = url[match.end() :]
    if WHITESPACE.search(payload):
        payload = WHITESPACE.sub("", payload)
    if len(payload) // 4 * 3 > max_bytes + 2:  # decoded size, checked before decoding
        raise ParamError(param, f"image is more than the {max_bytes} bytes allowed")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ParamError(param, "is not valid base64") from None


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    """`canvas serve`'s image input flags (defaults from `ImageLimits` and `MediaPolicy`)."""
    limits, policy = ImageLimits(), MediaPolicy()
    parser.add_argument(
        "--allowed-media-domains",
        nargs="*",
        default=[],
        metavar="DOMAIN",
        help="hosts (and their subdomains) whose http(s) image URLs the server fetches "
        "(default: none, images only inline as data: URLs)",
    )
    parser.add_argument(
        "--media-fetch-timeout",
        type=float,
        default=policy.fetch_timeout_s,
        help="seconds one remote image may take to fetch",
    )
    parser.add_argument(
        "--max-image-bytes", type=int, default=limits.max_image_bytes, help="bytes per image"
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=limits.max_image_pixels,
        help="pixels (width x height) per image, checked before decoding",
    )
    parser.add_argument(
        "--max-images-per-request",
        type=int,
        default=limits.max_images,
        help="images in one request",
    )


def build_media(args: argparse.Namespace, model_dir: Path, has_vision: bool) -> Media | None:
    """Image input for a checkpoint with a vision tower and an image processor config (None
    otherwise: image parts are then refused with a 400)."""
    from engine.inputs.images import ImageProcessor

    if not has_vision:
        return None
    policy = MediaPolicy(
        ImageLimits(args.max_image_bytes, args.max_image_pixels, args.max_images_per_request),
        frozenset(d.lower().strip(".") for d in args.allowed_media_domains),
        args.media_fetch_timeout,
    )
    start = time.perf_counter()
    try:
        processor = ImageProcessor(model_dir, policy.limits)
    except ValueError as exc:
        logger.warning("image input is off: %s", exc)
        return None
    logger.info("image input on (processor loaded in %.2fs)", time.perf_counter() - start)
    return Media(processor, policy)
