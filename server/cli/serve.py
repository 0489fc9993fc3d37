"""`canvas serve`'s flags: the checkpoint and engine flags of the configuration tree
(`server.cli.config`, defaults from the config dataclasses), and the server's own."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from uvicorn.config import LOG_LEVELS

from engine.checkpoints.default import placeholder_model_dir
from server.cli.config import (
    CHECKPOINT_FLAGS,
    ENGINE_FLAGS,
    add_flags,
    add_threads_flag,
    json_object,
)
from server.logs import LOG_FORMATS, use_log_format


class _PlaceholderModel(argparse.Action):
    """--placeholder-model: the placeholder checkpoint stands for --model."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        namespace.model = str(placeholder_model_dir())


class _ApiKeys(argparse.Action):
    """--api-key KEY...: the keys of every --api-key given; given at all, they replace the
    default (the environment's key) rather than extend it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest)
        keys = [] if given is self.default or given is None else list(given)
        setattr(namespace, self.dest, [*keys, *values])


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """`canvas serve`'s flags."""
    from server.media import add_media_arguments

    model = parser.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        default=None,
        help="checkpoint directory, or hub id org/name[@revision] (downloaded; see "
        "--download-dir) (default: built-in model)",
    )
    model.add_argument(
        "--placeholder-model",
        dest="model",
        action=_PlaceholderModel,
        help="serve a tiny random-weight checkpoint instead (demos and tests: output is noise)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free)")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients may pass as `model`; the first is the one /v1/models lists first "
        "and metrics are labelled with (default: the hub id without @revision, or the checkpoint "
        "directory's name)",
    )
    add_flags(parser, CHECKPOINT_FLAGS)
    add_flags(parser, ENGINE_FLAGS)
    add_threads_flag(parser)
    parser.add_argument(
        "--drain-seconds",
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="on SIGTERM/SIGINT, let running requests finish for up to this long (a second "
        "signal exits at once)",
    )
    env_key = os.environ.get("CANVAS_API_KEY")
    parser.add_argument(
        "--api-key",
        nargs="+",
        action=_ApiKeys,
        default=None if env_key is None else env_key.split(","),
        metavar="KEY",
        help="require one of these bearer keys on /v1; several keys after the flag, or the "
        "flag given several times (default: $CANVAS_API_KEY, one key or several separated by "
        "commas, which keeps them out of the process list; unset: no auth; empty: an error)",
    )
    add_chat_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="traceback of a start-up error")
    add_media_arguments(parser)
    add_http_arguments(parser)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    """How chats are rendered and what a request may carry: the reasoning field, the chat
    template and its default variables, unknown fields."""
    from server.render import REASONING_FIELDS

    parser.add_argument(
        "--reasoning-field",
        default="both",
        choices=tuple(REASONING_FIELDS),
        help="the field a chat's thoughts are sent under: 'reasoning' (vLLM's), "
        "'reasoning_content' (its older name) or both (default)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="the chat template to render conversations with instead of the checkpoint's: a "
        "Jinja file, or the template itself (a value with braces or a line break); rendered in "
        "the same sandbox as the checkpoint's",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=json_object,
        default=None,
        metavar="JSON",
        help="template variables every chat gets (a request's enable_thinking or "
        "reasoning_effort overrides enable_thinking), a JSON object: "
        "'{\"enable_thinking\": false}'",
    )
    parser.add_argument(
        "--ignore-unknown-params",
        action="store_true",
        help="drop and log (once per field name) the request fields Canvas does not know or "
        "does not honour, instead of refusing the request with a 400 naming the field",
    )


def json_strings(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's spelling: '["https://a.example"]')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'{text!r} is not a JSON list of strings, e.g. ["*"]')
    return value


def add_http_arguments(parser: argparse.ArgumentParser) -> None:
    """The HTTP front end's flags, spelt as vLLM's: the body limit, CORS, uvicorn's logging."""
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="request body limit in bytes, past which a request is a 413 (default: 4 MiB for "
        "the text, plus, when the model takes images, --max-images-per-request base64 data "
        "URLs of --max-image-bytes each)",
    )
    parser.add_argument(
        "--allowed-origins",
        type=json_strings,
        default=None,
        metavar="JSON",
        help='browser origins allowed by CORS, a JSON list (["*"]: any; default: CORS off, '
        "no origin but the server's own)",
    )
    for name, what in (("methods", "HTTP methods"), ("headers", "request headers")):
        parser.add_argument(
            f"--allowed-{name}",
            type=json_strings,
            default=["*"],
            metavar="JSON",
            help=f"{what} a CORS preflight may ask for, a JSON list (with --allowed-origins)",
        )
    parser.add_argument(
        "--allowed-credentials",
        action="store_true",
        help="CORS: allow credentials (cookies, HTTP auth); needs listed --allowed-origins",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=tuple(LOG_LEVELS),
        help="uvicorn's log level (its startup, error and access lines)",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or json: one JSON object per line (time, level, logger, message and "
        "the request id where known), uvicorn's lines too",
    )
    parser.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access line per request",
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from server.serve import StartupError, serve

    use_log_format(args.log_format)
    try:
        return serve(args)
    except StartupError as exc:
        print(f"canvas serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C while the weights load: no traceback
        return 130
