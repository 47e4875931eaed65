"""``odtctl init`` and ``odtctl ingest``: a new home, and images in."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from odtd.cli.output import command, emit, home_of, progress
from odtd.errors import ConfigError


@command("init")
def cmd_init(args: argparse.Namespace) -> int:
    """Create an ODTD_HOME."""
    from odtd.home.create import init_home, parse_classes
    from odtd.home.versions import check_model_name

    home = home_of(args)
    check_model_name(args.model)
    progress(f"initialising {home.root} with {args.model} ...")
    summary = init_home(
        home, args.model, parse_classes(args.classes),
        weights=Path(args.weights) if args.weights else None,
        validation=Path(args.validation) if args.validation else None, force=args.force,
        replay=Path(args.replay) if args.replay else None,
    )
    emit(args, summary,
         f"initialised {summary['home']}: {summary['model']} v{summary['version']} "
         f"({summary['param_count']:,} parameters, weights {summary['weights']}), "
         f"{summary['validation_samples']} validation images, "
         f"{summary['replay_samples']} replay images")
    return 0


@command("ingest")
def cmd_ingest(args: argparse.Namespace) -> int:
    """Ingest images as pending samples."""
    from odtd.home.ingest import Ingestor, discover

    home = home_of(args)
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


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
                reader: argparse.ArgumentParser) -> None:
    """Add ``init`` and ``ingest``."""
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
