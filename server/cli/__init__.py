"""The `canvas` command line, one module per command: serve (HTTP), generate (offline) and plan
(the memory plan), and the tooling commands (convert, train, eval, make-tiny) in
`server.cli.tools`. Every flag that describes a build is defined once, in the configuration
tree (`server.cli.config`), and every command maps its arguments onto config objects whose
defaults are written once, in the config dataclasses."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence
from typing import Any

from server.logs import TEXT_LINE

Command = Callable[[argparse.Namespace], int]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where the help already says it (a default
    that depends on the environment, such as --api-key's, is described, never printed) or
    there is none to show (None, or a switch: a store_false one's True would read as the
    flag's effect)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or action.nargs == 0 or "default" in text:
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser, whose --help shows the defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    """The parser and each subcommand's handler."""
    from server.cli.generate import add_generate_arguments, cmd_generate
    from server.cli.plan import add_plan_arguments, cmd_plan
    from server.cli.serve import add_serve_arguments, cmd_serve
    from server.cli.tools import add_parsers

    parser = argparse.ArgumentParser(prog="canvas", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    add_generate_arguments(
        sub.add_parser("generate", help="generate offline for one prompt and print stats")
    )
    add_serve_arguments(sub.add_parser("serve", help="start the OpenAI-compatible HTTP server"))
    add_plan_arguments(
        sub.add_parser("plan", help="print the memory plan at a model's shapes on an H100/H200")
    )
    commands = {"generate": cmd_generate, "serve": cmd_serve, "plan": cmd_plan}
    return parser, {**commands, **add_parsers(sub)}


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format=TEXT_LINE)
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    return commands[args.command](args)
