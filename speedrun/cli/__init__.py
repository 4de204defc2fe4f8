"""The ``speedrun`` command.

Each area registers its subcommands from its own module (``speedrun.cli.<area>``); this module
only builds the top-level parser and turns known errors into one clear line and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that define ``register(subparsers)``; each adds its subcommands.
_AREAS = ("speedrun.cli.train", "speedrun.cli.data", "speedrun.cli.evidence")

_EPILOG = """\
examples:
  speedrun train                         train the tiny GPT on the built-in corpus (CPU, minutes)
  speedrun train --preset small --data 'data/fineweb10B/fineweb_train_*.bin'
                                         validates on fineweb_val_*.bin (--val-data to choose)
  speedrun data inspect data/fineweb10B/fineweb_val_000000.bin
  speedrun stats logs/                   final losses, times and t-tests of a set of runs
  speedrun doctor                        check this machine before a timed run

Run 'speedrun COMMAND --help' for the options of one command.
"""


class UserError(Exception):
    """An error caused by the user's input; printed as one line without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speedrun",
        description="Train a GPT to a target validation loss as fast as the hardware allows, "
        "and produce evidence you can trust about how fast.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from speedrun import __version__

    parser.add_argument("--version", action="version", version=f"speedrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _AREAS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:  # an area not built yet must not break the others
            if e.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from speedrun.errors import SpeedrunError

    try:
        rc = args.func(args)
    except (UserError, SpeedrunError) as e:
        print(f"speedrun {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"speedrun {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)
