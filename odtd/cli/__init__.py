"""``odtctl``: the command-line interface. Read commands read SQLite; control commands use the socket.

Owns: the argument parser and dispatch (here), one module per command group (``setup``,
``sessions``, ``models``, ``simulate``, ``profiling``, ``telemetry``, ``doctor``), and what they share
(``output``: the handler registry, JSON/text output, progress, the home). May import every
other package, always lazily inside a handler, so ``odtctl --help`` and ``odtctl status`` stay
fast and never load TensorFlow.

Only this package (and the daemon's entry point) prints and exits: an ``OdtdError``, or a
filesystem error of a full, read-only or vanished disk (``errors.as_odtd_error``), becomes one
``Error: ...`` line and exit status 1.
"""

from __future__ import annotations

import argparse
import logging
import sqlite3
import sys
from typing import Optional

from odtd import __version__
from odtd.cli import doctor, fleet, models, profiling, sessions, setup, simulate, telemetry
from odtd.cli.output import COMMANDS, home_of
from odtd.errors import OdtdError, as_odtd_error

# The order of `odtctl --help`.
_GROUPS = (setup, sessions, models, simulate, fleet, profiling, telemetry, doctor)


def build_parser() -> argparse.ArgumentParser:
    """Build the ``odtctl`` argument parser (every command has help)."""
    parser = argparse.ArgumentParser(
        prog="odtctl", description="Control and inspect odtd, the on-device continual-learning daemon.",
    )
    parser.add_argument("--version", action="version", version=f"odtd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    home_help = "state directory (default: $ODTD_HOME or /var/lib/odtd)"
    parser.add_argument("--home", help=home_help)
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: `odtctl --home D status` and `odtctl status --home D` both work.
    common.add_argument("--home", default=argparse.SUPPRESS, help=home_help)
    reader = argparse.ArgumentParser(add_help=False, parents=[common])
    reader.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in _GROUPS:
        group.add_parsers(sub, common, reader)
    return parser


# Options whose values may begin with a dash (argparse would take "-1-1" for an option).
DASHED_VALUES = ("--input-scale",)


def join_dashed_values(argv: list[str]) -> list[str]:
    """``--input-scale -1-1`` as ``--input-scale=-1-1``, the one spelling argparse accepts."""
    out: list[str] = []
    values = iter(argv)
    for arg in values:
        if arg in DASHED_VALUES:
            value = next(values, None)
            out.append(arg if value is None else f"{arg}={value}")
        else:
            out.append(arg)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``odtctl``."""
    parser = build_parser()
    args = parser.parse_args(join_dashed_values(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.command:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:
        return 1
    except (OdtdError, OSError, sqlite3.Error) as exc:
        # A full, read-only or vanished disk: one line too, judged by the home's database.
        reported = as_odtd_error(exc, home_of(args).db_path)
        if reported is None:
            raise
        lines = str(reported).splitlines() or [type(exc).__name__]
        for line in lines:
            print(f"Error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return 130
