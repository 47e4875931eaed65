"""What every ``odtctl`` command shares: the handler registry, output, progress, the home.

Command modules import from here, and ``odtd.cli`` imports the command modules: no cycle.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Optional

from odtd.config import resolve_home
from odtd.home.paths import Home

Handler = Callable[[argparse.Namespace], int]

COMMANDS: dict[str, Handler] = {}  # filled by @command as the command modules are imported


def command(name: str) -> Callable[[Handler], Handler]:
    """Register a handler for a sub-command."""

    def register(func: Handler) -> Handler:
        COMMANDS[name] = func
        return func

    return register


def emit(args: argparse.Namespace, data: Any, text: Optional[str] = None) -> None:
    """Print JSON with ``--json``, else ``text`` (or the JSON when there is no text form)."""
    if getattr(args, "json", False) or text is None:
        print(json.dumps(data, indent=2, sort_keys=False, default=str))
    else:
        print(text)


_progress_closed = False  # set once stderr is gone: the work goes on without progress lines


def progress(message: str) -> None:
    """Progress for long work goes to stderr, so ``--json`` output stays clean.

    A reader that went away (``odtctl train-now --foreground 2>&1 | head``) ends the progress
    lines, not the work: a session half done is not failed because nobody reads along.
    """
    global _progress_closed
    if _progress_closed:
        return
    try:
        print(message, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: stderr was closed
        _progress_closed = True


def home_of(args: argparse.Namespace) -> Home:
    """The home a command works on: ``--home``, else ``$ODTD_HOME``, else /var/lib/odtd."""
    return Home(resolve_home(getattr(args, "home", None)))

