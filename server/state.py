"""What the server holds for its lifetime: the engine client, the tokenizer, the validator,
the HTTP limits, the CORS policy and the admission count."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.params import DecodingDefaults
from engine.types import EngineClient
from engine.validation import RequestValidator
from server.metrics import Metrics

if TYPE_CHECKING:  # the tokenizer module loads transformers; the server only calls it
    from engine.inputs.images import ImageLimits
    from engine.inputs.tokenizer import Tokenizer
    from server.lenient import UnknownParams
    from server.media import Media


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one HTTP client may hold or send. Bodies over `max_body_bytes` (counted as read,
    chunked too) are 413; a request head must arrive within `header_timeout_s` and its body
    within `body_timeout_s` of the head (else 408 / the connection is closed); an idle
    keep-alive connection is closed after `keep_alive_timeout_s`. Heads over
    `max_header_bytes` are refused by the HTTP parser, over `max_header_count` fields 431."""

    max_body_bytes: int = 4 << 20
    max_header_bytes: int = 32 << 10
    max_header_count: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: int = 5

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_header_bytes, self.max_header_count) < 1:
            raise ValueError("HTTP size limits must be >= 1")
        if min(self.header_timeout_s, self.body_timeout_s, self.keep_alive_timeout_s) <= 0:
            raise ValueError("HTTP timeouts must be > 0")


# What a request's text may take (messages, tools, schema), beside its inline images.
TEXT_BODY_BYTES = HttpLimits().max_body_bytes


def request_body_limit(images: ImageLimits | None) -> int:
    """The default body limit: `TEXT_BODY_BYTES`, plus, when the server takes images, the
    base64 data URLs of as many images as a request may carry, each of the largest size
    allowed (base64 is 4 bytes per 3, rounded up), so no image the image limits allow is
    refused as a 413 before it is checked by name."""
    if images is None:
        return TEXT_BODY_BYTES
    data_url_bytes = -(-images.max_image_bytes // 3) * 4
    return TEXT_BODY_BYTES + images.max_images * data_url_bytes


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """Which browser origins may call the server (CORS): `origins` ("*": any), the methods
    and headers a preflight may ask for, and whether credentials (cookies, HTTP auth) are
    allowed. Credentials with any origin are refused: the middleware would echo every
    origin back, so any web page could send the browser's credentials."""

    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def __post_init__(self) -> None:
        if self.credentials and "*" in self.origins:
            raise ValueError(
                "--allowed-credentials with '*' in --allowed-origins would let every web page "
                "send a browser's credentials: list the origins"
            )


class Ticket:
    """Engine slots held for one admitted request; `release` (idempotent) returns them."""

    __slots__ = ("_admission", "_num_requests")

    def __init__(self, admission: Admission, num_requests: int) -> None:
        self._admission = admission
        self._num_requests = num_requests

    def release(self) -> None:
        self._admission.num_admitted -= self._num_requests
        self._num_requests = 0


@dataclass(slots=True)
class Admission:
    """Engine requests the server has admitted and not yet seen end. A request is counted when
    it passes its checks, before its response starts (the engine counts a request only once
    its generator first runs, after a stream's 200 went out), so a stream that got its headers
    always has its slots and overload is always a real 429. Event-loop only."""

    capacity: int  # the engine's max_inflight
    num_admitted: int = 0

    def admit(self, num_requests: int, num_engine_inflight: int) -> Ticket | None:
        """A ticket for `num_requests` engine requests, or None when they do not fit."""
        if max(self.num_admitted, num_engine_inflight) + num_requests > self.capacity:
            return None
        self.num_admitted += num_requests
        return Ticket(self, num_requests)


@dataclass(slots=True)
class ServerState:
    engine: EngineClient
    tokenizer: Tokenizer | None
    defaults: DecodingDefaults
    model_name: str  # the first served name: metrics are labelled with it
    other_names: tuple[str, ...] = ()  # `--served-model-name`'s further names, served as well
    api_keys: tuple[str, ...] = ()  # a request needs one of them on the guarded paths; (): none
    reasoning_field: str = "both"  # `--reasoning-field`: a key of server.render.REASONING_FIELDS
    http: HttpLimits = field(default_factory=HttpLimits)
    ready: bool = False
    draining: bool = False
    media: Media | None = None  # image input (a vision checkpoint), else image parts are 400s
    cors: CorsPolicy | None = None  # None: no CORS headers (browsers keep other origins out)
    # `--ignore-unknown-params`: unknown and unsupported fields are dropped (logged), not 400s
    unknown_params: UnknownParams | None = None
    metrics: Metrics = field(init=False)
    validator: RequestValidator = field(init=False)
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.engine.limits.max_inflight)
        self.metrics = Metrics(self.model_name, self.engine.limits.canvas_length)
        self.validator = RequestValidator(self.defaults, self.engine.limits)

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request may pass as `model`, the first one first."""
        return (self.model_name, *self.other_names)

    def response_name(self, requested: str | None) -> str:
        """The `model` a response carries: the served name the request used (as vLLM
        answers), else (none given, or a name not served, which is refused) the first."""
        if requested is not None and requested in self.other_names:
            return requested
        return self.model_name
