"""``odtctl telemetry backends|record|playback`` and ``odtctl metrics``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from odtd.cli.output import command, emit, home_of, progress
from odtd.errors import ConfigError
from odtd.table import table


@command("telemetry")
def cmd_telemetry(args: argparse.Namespace) -> int:
    """Telemetry backends, recording and offline integration."""
    from odtd import telemetry

    if args.action == "backends":
        rows = telemetry.describe_backends()
        order = list(telemetry.BACKENDS)
        lines = table(([f"{order.index(row['name']) + 1}." if row["name"] in order else "-",
                        row["name"],
                        "available" if row["available"] else f"unavailable: {row['reason']}"]
                       for row in rows), gap=" ")
        lines.append("auto picks the first available in this order; playback is chosen by name")
        emit(args, rows, "\n".join(lines))
        return 0
    if args.action == "record":
        if not args.out or not args.seconds:
            raise ConfigError("telemetry record: --seconds S and --out FILE.jsonl are required")
        backend = telemetry.open_backend(args.backend)
        try:
            progress(f"recording {args.seconds} s from {backend.source} ...")
            result = telemetry.record(backend, args.seconds, Path(args.out),
                                      interval_s=(args.interval_ms or 10.0) / 1000.0)
        finally:
            backend.close()
        emit(args, result, f"wrote {result['samples']} samples from {result['source']} to "
                           f"{result['path']} (mean interval {result['achieved_interval_s']} s)")
        return 0
    if args.action == "replay":  # the first name, before "replay" meant the rehearsal buffer alone
        print("odtctl telemetry replay is deprecated: use odtctl telemetry playback",
              file=sys.stderr)
        args.action = "playback"
    if args.action == "playback":
        if not args.file:
            raise ConfigError("telemetry playback: give the recording FILE")
        result = telemetry.integrate_recording(Path(args.file), fmt=args.format,
                                               interval_ms=args.interval_ms)
        rails = ", ".join(f"{k} {v:.2f} J" for k, v in sorted(result["energy_by_rail_j"].items()))
        total = "-" if result["total_j"] is None else f"{result['total_j']:.2f} J"
        basis = result["total_rail"] or "sum of rails (no input rail)"
        emit(args, result, f"{result['samples']} samples over {result['duration_s']:.2f} s "
                           f"({result['source']}): total {total} = {basis}; coverage "
                           f"{result['coverage']:.1%}\nrails: {rails}")
        return 0
    raise ConfigError(f"telemetry: unknown action {args.action!r}")


@command("metrics")
def cmd_metrics(args: argparse.Namespace) -> int:
    """Print Prometheus text format (node_exporter's textfile collector), or write it atomically."""
    from odtd.report.metrics import prometheus_text, write_textfile

    home = home_of(args)
    store = home.open_store()
    try:
        if args.out:
            write_textfile(Path(args.out), home, store)
        else:
            print(prometheus_text(home, store), end="")
    finally:
        store.close()
    return 0


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
                reader: argparse.ArgumentParser) -> None:
    """Add the telemetry and metrics sub-commands."""
    p = sub.add_parser("telemetry", parents=[reader], help="power backends, record, playback",
                       description="backends: which telemetry backends work here and why not. "
                                   "record: samples from a backend to jsonl. playback: integrate a "
                                   "recording (jsonl or a tegrastats log) to check odtd's "
                                   "arithmetic (replay: its former name, deprecated).")
    p.add_argument("action", choices=["backends", "record", "playback", "replay"],
                   metavar="{backends,record,playback}")
    p.add_argument("file", nargs="?", help="playback: the recording")
    p.add_argument("--backend", default="auto", help="record: backend name (default auto)")
    p.add_argument("--seconds", type=float, help="record: how long")
    p.add_argument("--out", help="record: output .jsonl")
    p.add_argument("--format", choices=["jsonl", "tegrastats"], default="jsonl",
                   help="playback: file format (default jsonl)")
    p.add_argument("--interval-ms", type=float, default=None,
                   help="playback: interval of a tegrastats log; record: sampling interval "
                   "(default 10)")
    p = sub.add_parser("metrics", parents=[common], help="Prometheus text format for node_exporter",
                       description="Print the last session's accuracy, energy and peak memory, "
                                   "sessions by outcome, daemon up and samples pending in "
                                   "Prometheus text format.")
    p.add_argument("--out", help="write atomically to this file (e.g. the textfile collector dir)")
