"""``odtctl``: the command-line interface. Read commands read SQLite; control commands use the socket.

Only this module (and ``daemon.py``) prints and exits: an ``OdtdError`` becomes one
``Error: ...`` line and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

from odtd import __version__
from odtd.config import resolve_home
from odtd.errors import ConfigError, OdtdError
from odtd.home import Home

logger = logging.getLogger(__name__)

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}  # filled by @command


Handler = Callable[[argparse.Namespace], int]


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


def progress(message: str) -> None:
    """Progress for long work goes to stderr, so ``--json`` output stays clean."""
    print(message, file=sys.stderr, flush=True)


def _home(args: argparse.Namespace) -> Home:
    return Home(resolve_home(args.home))


# -- init, ingest --------------------------------------------------------------------------


@command("init")
def cmd_init(args: argparse.Namespace) -> int:
    """Create an ODTD_HOME."""
    from odtd.models import check_model_name
    from odtd.setup_home import init_home, parse_classes

    home = _home(args)
    check_model_name(args.model)
    progress(f"initialising {home.root} with {args.model} ...")
    summary = init_home(
        home, args.model, parse_classes(args.classes),
        weights=Path(args.weights) if args.weights else None,
        validation=Path(args.validation) if args.validation else None, force=args.force,
        replay=Path(args.replay) if args.replay else None,
    )  # fmt: skip
    emit(args, summary,
         f"initialised {summary['home']}: {summary['model']} v{summary['version']} "
         f"({summary['param_count']:,} parameters, weights {summary['weights']}), "
         f"{summary['validation_samples']} validation images, "
         f"{summary['replay_samples']} replay images")  # fmt: skip
    return 0


@command("ingest")
def cmd_ingest(args: argparse.Namespace) -> int:
    """Ingest images as pending samples."""
    from odtd.ingest import Ingestor, discover

    home = _home(args)
    day = _check_day(args.day)
    files = discover(Path(args.path), args.label)
    store = home.open_store()
    try:
        shape = store.meta("input_shape")
        ingestor = Ingestor(home, store, store.meta("classes"), (shape[1], shape[0]))
        show = None if args.json or len(files) < 500 else \
            (lambda done, total: progress(f"ingested {done}/{total}"))
        report = ingestor.ingest(files, day=day, progress=show)
    finally:
        store.close()
    data = report.as_dict()
    lines = [f"accepted {report.accepted} ({report.holdout} held out for evaluation), "
             f"duplicates {report.duplicates}, rejected {report.rejected}"]
    lines += [f"  rejected {item['path']}: {item['reason']}" for item in report.rejected_files]
    emit(args, data, "\n".join(lines))
    return 0


def _check_day(day: Optional[str]) -> Optional[str]:
    from datetime import date

    if day is None:
        return None
    try:
        return date.fromisoformat(day).isoformat()
    except ValueError:
        raise ConfigError(f"--day {day!r}: expected a date as YYYY-MM-DD") from None


# -- sessions ------------------------------------------------------------------------------


@command("train-now")
def cmd_train_now(args: argparse.Namespace) -> int:
    """Run a session now: through the daemon, or in this process with --foreground."""
    if not args.foreground:
        from odtd.control import request_train_now

        session = request_train_now(_home(args), wait=args.wait, force=args.force)
        text = _session_line(session) if "outcome" in session else \
            "session started in the daemon; follow it with `odtctl status`"
        emit(args, session, text)
        return 0
    session = run_foreground_session(_home(args), trigger="cli", force=args.force)
    emit(args, session, _session_line(session))
    return 0 if session["outcome"] != "failed" else 1


def run_foreground_session(home: Home, trigger: str, day: Optional[str] = None,
                           force: bool = False) -> dict[str, Any]:
    """Run one session in this process tree; Ctrl-C or SIGTERM stop it at a step boundary."""
    from odtd.energy_meter import SessionEnergyMeter, running_sampler
    from odtd.policy import load_policy
    from odtd.session import SessionRunner

    store = home.open_store()
    stop = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        stop.reason = f"stopped by {signal.Signals(signum).name}"  # type: ignore[attr-defined]
        stop.set()

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        config = home.load_config()
        policy = load_policy(home.policy_path(config))
        with running_sampler(config.telemetry) as sampler:
            runner = SessionRunner(home, store, config, policy, progress=progress,
                                   energy_meter=SessionEnergyMeter(sampler))
            return runner.run(trigger=trigger, day=day, stop=stop, force=force)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.close()


def _session_line(s: dict[str, Any]) -> str:
    from odtd.report import _pct, energy_text

    return (f"session {s['id']} {s['outcome']}: {s['reason']}; accuracy {_pct(s['accuracy_before'])}"
            f" -> {_pct(s['accuracy_after'])}; model v{s['model_version_before']} -> "
            f"v{s['model_version_after']}; {s['samples_new']} new + {s['samples_replay']} replay "
            f"samples, {s['steps']} steps, {s['duration_s']} s, energy {energy_text(s)}, "
            f"peak {s['peak_memory_mb']} MB")  # fmt: skip


@command("status")
def cmd_status(args: argparse.Namespace) -> int:
    """Show the daemon, the model, the samples and recent sessions."""
    from odtd.report import render_status, status

    home = _home(args)
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
    from odtd.report import sessions_table

    store = _home(args).open_store()
    try:
        sessions = store.sessions(limit=args.limit)
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
    from odtd.control import request

    home = _home(args)
    home.require()
    result = request(home.socket_path, op)
    emit(args, result, text)
    return 0


@command("plot")
def cmd_plot(args: argparse.Namespace) -> int:
    """Write accuracy, energy and peak memory over the sessions to a PNG."""
    from odtd.plot import plot_sessions

    home = _home(args)
    store = home.open_store()
    try:
        sessions = list(reversed(store.sessions(limit=args.limit, done_only=True)))
        title = f"odtd: {store.meta('model')} in {home.root}"
    finally:
        store.close()
    out = plot_sessions(sessions, Path(args.out), title)
    emit(args, {"out": str(out), "sessions": len(sessions)}, f"wrote {out} ({len(sessions)} sessions)")
    return 0


# -- models --------------------------------------------------------------------------------


@command("models")
def cmd_models(args: argparse.Namespace) -> int:
    """List the model registry, or a home's versions; roll back; export."""
    from odtd.trainer import catalog

    action = args.action or "list"
    if action == "list":
        rows = [{"name": info.name, "description": info.description,
                 "input_shape": list(info.input_shape),
                 "param_count": catalog.param_count(name, 10)}
                for name, info in catalog.MODELS.items()]  # fmt: skip
        text = "\n".join(f"{r['name']:<12} {r['param_count']:>10,} parameters (10 classes)  "
                         f"{r['description']}" for r in rows)  # fmt: skip
        emit(args, rows, text)
        return 0
    from odtd import versions

    home = _home(args)
    store = home.open_store()
    try:
        if action == "versions":
            rows = versions.list_versions(home, store)
            from odtd.report import _pct

            text = "\n".join(
                f"{'*' if r['current'] else ' '} v{r['version']:<4} parent {r['parent']!s:<5} "
                f"session {r['session_id']!s:<5} accuracy {_pct(r['accuracy']):<6} "
                f"{r['state']:<7} {r['sha256'][:12]}  {r['created_at']}" for r in rows)  # fmt: skip
            emit(args, rows, text)
        elif action == "rollback":
            result = versions.rollback(home, store, _version_arg(args))
            emit(args, result, f"{result['model']} v{result['version']} is current "
                               f"(was v{result['previous']})")  # fmt: skip
        elif action == "export":
            if not args.out:
                raise ConfigError("models export: --out FILE.npz is required")
            result = versions.export(home, store, _version_arg(args), Path(args.out))
            emit(args, result, f"exported {result['model']} v{result['version']} to {result['out']} "
                               f"(sha256 {result['sha256'][:12]})")  # fmt: skip
    finally:
        store.close()
    return 0


def _version_arg(args: argparse.Namespace) -> int:
    text = (args.version or "").lstrip("v")
    if not text.isdigit():
        raise ConfigError(f"models {args.action}: VERSION {args.version!r} must be a number like 3 or v3")
    return int(text)


# -- simulate ------------------------------------------------------------------------------


@command("simulate")
def cmd_simulate(args: argparse.Namespace) -> int:
    """Run N days of the daily cycle through the real session path."""
    from odtd.simulate import SimulationOptions, simulate

    options = SimulationOptions(
        days=args.days, per_day=args.per_day, model=args.model, dataset=args.dataset,
        pretrain_samples=args.pretrain_samples, pretrain_epochs=args.pretrain_epochs,
        validation_samples=args.validation_samples, fresh=args.fresh, seed=args.seed,
        policy=args.policy,
    )  # fmt: skip
    result = simulate(_home(args), options, progress=progress)
    emit(args, result, None if args.json else "\n".join(result["table"]))
    return 0


# -- the parser ----------------------------------------------------------------------------


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

    p = sub.add_parser("init", parents=[reader], help="create an ODTD_HOME with model version 0",
                       description="Create ODTD_HOME: config, policy, database, model v0, validation set. "
                       "The policy is the model's own recipe where it has one (policies/<model>.yaml), "
                       "else policies/default.yaml; an existing policy file is kept.")
    p.add_argument("--model", required=True, help="registry name (see `odtctl models`)")
    p.add_argument("--weights",
                   help="starting weights (.npz from `odtctl models export`); default: fresh init")
    p.add_argument("--classes", help="comma-separated class names (default: the ten CIFAR-10 classes)")
    p.add_argument("--validation", help="directory of <label>/<image> files: the fixed validation set")
    p.add_argument("--replay", help="directory of <label>/<image> files the base model was trained on: "
                   "they seed the replay buffer")
    p.add_argument("--force", action="store_true", help="replace an existing home (deletes its state)")

    p = sub.add_parser("ingest", parents=[reader], help="add images as pending samples",
                       description="Add images: a file (with --label), a <label>/<file> directory, "
                                   "or a CSV manifest 'path,label'. Bad files are quarantined.")
    p.add_argument("path", help="image file, directory or .csv manifest")
    p.add_argument("--label", help="label for a single file (or loose files in a directory)")
    p.add_argument("--day", help="YYYY-MM-DD the samples belong to (default: today)")

    p = sub.add_parser("train-now", parents=[reader], help="run a training session now",
                       description="Ask the daemon for a session now, or run it here with --foreground.")
    p.add_argument("--foreground", action="store_true", help="run the session in this process, no daemon")
    p.add_argument("--wait", action="store_true", help="wait for the daemon's session and print it")
    p.add_argument("--force", action="store_true", help="bypass the policy's gates (never memory safety)")

    p = sub.add_parser("status", parents=[reader], help="daemon, model, samples and recent sessions")
    p.add_argument("--limit", type=int, default=10, help="sessions to show (default 10)")

    p = sub.add_parser("history", parents=[reader], help="sessions, most recent first")
    p.add_argument("--limit", type=int, default=50, help="sessions to show (default 50)")

    p = sub.add_parser("plot", parents=[reader], help="accuracy, energy and memory over days, to PNG",
                       description="Draw accuracy (validation set and device hold-out), energy per "
                                   "session and peak memory over the sessions into one PNG "
                                   "(needs matplotlib: pip install 'odtd[plot]').")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--limit", type=int, default=365, help="most recent sessions to draw (default 365)")

    p = sub.add_parser("models", parents=[reader], help="model registry, versions, rollback, export",
                       description="With no action: the registry with parameter counts. "
                                   "versions | rollback VERSION | export VERSION --out FILE.npz")
    p.add_argument("action", nargs="?", choices=["list", "versions", "rollback", "export"])
    p.add_argument("version", nargs="?", help="version number for rollback/export (e.g. 3 or v3)")
    p.add_argument("--out", help="export: output .npz path")

    p = sub.add_parser("simulate", parents=[reader], help="simulate days of the daily cycle",
                       description="Run N days (ingest K samples stamped with that day, then a "
                                   "session) through the same code as real sessions.")
    p.add_argument("--days", type=int, default=7, help="days to simulate (default 7)")
    p.add_argument("--per-day", type=int, default=64, help="new samples per day (default 64)")
    p.add_argument("--model", default="tinycnn", help="model when the home is created (default tinycnn)")
    p.add_argument("--dataset", default="synthetic",
                   help="'synthetic' (built in) or a <split>/<class>/*.jpg directory or CIFAR-10 .tar.gz")
    p.add_argument("--pretrain-samples", type=int, default=2000,
                   help="server-side pre-training samples when the home is created (0: none)")
    p.add_argument("--pretrain-epochs", type=int, default=4, help="pre-training epochs (default 4)")
    p.add_argument("--validation-samples", type=int, default=500,
                   help="fixed validation set size when the home is created")
    p.add_argument("--fresh", action="store_true", help="re-create the home first (deletes its state)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data draws")
    p.add_argument("--policy", help="policy file to install when the home is created")

    for name, text in (("pause", "hold scheduled sessions (the daemon keeps running)"),
                       ("resume", "resume scheduled sessions"),
                       ("reload", "make the daemon re-read odtd.yaml and the policy")):
        sub.add_parser(name, parents=[reader], help=text, description=text[0].upper() + text[1:] + ".")

    # Command groups in their own modules; importing them registers their handlers.
    from odtd import cli_policy, cli_telemetry

    cli_policy.add_parsers(sub, common, reader)
    cli_telemetry.add_parsers(sub, common, reader)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of ``odtctl``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.command:
        parser.print_help()
        return 2
    try:
        return COMMANDS[args.command](args)
    except OdtdError as exc:
        lines = str(exc).splitlines() or [type(exc).__name__]
        for line in lines:
            print(f"Error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 1


if __name__ == "__main__":
    # `python -m odtd.cli` runs this file as __main__, a second copy of odtd.cli: delegate to the
    # imported module, whose COMMANDS also holds the handlers other modules register.
    from odtd.cli import main as _main

    sys.exit(_main())
