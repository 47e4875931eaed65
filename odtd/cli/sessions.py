"""Sessions and the daemon: train-now, status, history, pause, resume, reload, plot."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from odtd.cli.output import command, emit, home_of, progress


@command("train-now")
def cmd_train_now(args: argparse.Namespace) -> int:
    """Run a session now: through the daemon, or in this process with --foreground."""
    if not args.foreground:
        from odtd.daemon.control import request_train_now

        session = request_train_now(home_of(args), wait=args.wait, force=args.force)
        text = _session_line(session) if "outcome" in session else \
            "session started in the daemon; follow it with `odtctl status`"
        emit(args, session, text)
        return 0
    from odtd.session.process import run_session_here

    session = run_session_here(home_of(args), trigger="cli", force=args.force,
                               progress=progress).to_dict()
    emit(args, session, _session_line(session))
    return 0 if session["outcome"] != "failed" else 1


def _session_line(s: dict[str, Any]) -> str:
    from odtd.report.status import energy_text, pct

    line = f"session {s['id']} {s['outcome']}: {s['reason']}"
    if s["steps"] is None:  # skipped or failed before training: nothing else was measured
        return line
    return (f"{line}; accuracy {pct(s['accuracy_before'])} -> {pct(s['accuracy_after'])}; model "
            f"v{s['model_version_before']} -> v{s['model_version_after']}; {s['samples_new']} new "
            f"+ {s['samples_replay']} replay samples, {s['steps']} steps, {s['duration_s']} s, "
            f"energy {energy_text(s)}, peak {s['peak_memory_mb']} MB")


@command("status")
def cmd_status(args: argparse.Namespace) -> int:
    """Show the daemon, the model, the samples and recent sessions."""
    from odtd.report.status import render_status, status

    home = home_of(args)
    store = home.open_store()
    try:
        data = status(home, store, limit=args.limit)
    finally:
        store.close()
    emit(args, data, render_status(data))
    return 0


@command("history")
def cmd_history(args: argparse.Namespace) -> int:
    """List sessions, most recent first."""
    from odtd.report.status import session_objects, sessions_table

    store = home_of(args).open_store()
    try:
        sessions = session_objects(store, args.limit)
    finally:
        store.close()
    emit(args, sessions, "\n".join(sessions_table(sessions)) if sessions else "no sessions yet")
    return 0


@command("pause")
def cmd_pause(args: argparse.Namespace) -> int:
    """Hold scheduled sessions."""
    return _control(args, "pause", "scheduled sessions paused (train-now still works)")


@command("resume")
def cmd_resume(args: argparse.Namespace) -> int:
    """Resume scheduled sessions."""
    return _control(args, "resume", "scheduled sessions resumed")


@command("reload")
def cmd_reload(args: argparse.Namespace) -> int:
    """Ask the daemon to re-read odtd.yaml and the policy."""
    return _control(args, "reload", "config and policy reloaded")


def _control(args: argparse.Namespace, op: str, text: str) -> int:
    from odtd.daemon.control import request

    home = home_of(args)
    home.require()
    result = request(home.socket_path, op)
    emit(args, result, text)
    return 0


@command("plot")
def cmd_plot(args: argparse.Namespace) -> int:
    """Write accuracy, energy and peak memory over the sessions (or a reproduction's arms) to a PNG."""
    from odtd.report.plot import plot_arms, plot_sessions, read_summary

    if args.arms:
        summary = read_summary(Path(args.arms))
        out = plot_arms(summary, Path(args.out))
        emit(args, {"out": str(out), "arms": summary["arms"]},
             f"wrote {out} ({len(summary['arms'])} arms, {summary['days']} days)")
        return 0
    home = home_of(args)
    store = home.open_store()
    try:
        sessions = [s.to_dict() for s in reversed(store.sessions(limit=args.limit, done_only=True))]
        title = f"odtd: {store.meta('model')} in {home.root}"
    finally:
        store.close()
    out = plot_sessions(sessions, Path(args.out), title)
    emit(args, {"out": str(out), "sessions": len(sessions)}, f"wrote {out} ({len(sessions)} sessions)")
    return 0


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
                reader: argparse.ArgumentParser) -> None:
    """Add the session and daemon-control commands."""
    p = sub.add_parser("train-now", parents=[reader], help="run a training session now",
                       description="Ask the daemon for a session now, or run it here with --foreground.")
    p.add_argument("--foreground", action="store_true", help="run the session in this process, no daemon")
    p.add_argument("--wait", action="store_true", help="wait for the daemon's session and print it")
    p.add_argument("--force", action="store_true",
                   help="bypass the policy's gates and its wait for new samples (never memory safety)")

    p = sub.add_parser("status", parents=[reader], help="daemon, model, samples and recent sessions")
    p.add_argument("--limit", type=int, default=10, help="sessions to show (default 10)")

    p = sub.add_parser("history", parents=[reader], help="sessions, most recent first")
    p.add_argument("--limit", type=int, default=50, help="sessions to show (default 50)")

    p = sub.add_parser("plot", parents=[reader], help="accuracy, energy and memory over days, to PNG",
                       description="Draw accuracy (validation set and device hold-out), energy per "
                                   "session and peak memory over the sessions into one PNG, or "
                                   "a reproduction's arms with --arms "
                                   "(needs matplotlib: pip install 'odtd[plot]').")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--limit", type=int, default=365, help="most recent sessions to draw (default 365)")
    p.add_argument("--arms", metavar="SUMMARY.json",
                   help="instead, draw every arm of a reproduction per day, shifted and clean, "
                        "from the summary `scripts/reproduce_tx2_daily.py --json` printed")

    for name, text in (("pause", "hold scheduled sessions (the daemon keeps running)"),
                       ("resume", "resume scheduled sessions"),
                       ("reload", "make the daemon re-read odtd.yaml and the policy")):
        sub.add_parser(name, parents=[reader], help=text, description=text[0].upper() + text[1:] + ".")
