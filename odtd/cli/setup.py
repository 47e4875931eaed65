"""``odtctl init`` and ``odtctl ingest``: a new home, and images in."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from odtd.cli.output import command, emit, home_of, progress
from odtd.errors import ConfigError
from odtd.home.paths import REFERENCE_EVERY, Home

if TYPE_CHECKING:
    from odtd.session.check import PolicyCheck


@command("init")
def cmd_init(args: argparse.Namespace) -> int:
    """Create an ODTD_HOME."""
    from odtd.home.create import InitRequest, init_home
    from odtd.home.spec import builtin_input_shape, check_model_name, parse_classes, parse_input_size

    home = home_of(args)
    if (args.model is None) == (args.model_file is None):
        raise ConfigError("init: give --model NAME (a built-in network, see `odtctl models`) or "
                          "--model-file FILE.keras|.h5 (your own Keras classifier), not both")
    if args.model_file is not None and args.weights:
        raise ConfigError("init: --weights goes with --model; a --model-file brings its own")
    input_size = parse_input_size(args.input_size)
    if args.model is not None:
        check_model_name(args.model)
        builtin_input_shape(args.model, input_size)  # a refused size before any progress line
    progress(f"initialising {home.root} with {args.model or args.model_file} ...")
    summary = init_home(home, InitRequest(
        args.model, parse_classes(args.classes),
        weights=Path(args.weights) if args.weights else None,
        validation=Path(args.validation) if args.validation else None, force=args.force,
        replay=Path(args.replay) if args.replay else None, reference_every=args.reference_every,
        model_file=Path(args.model_file) if args.model_file else None, name=args.name,
        input_scale=args.input_scale, output=args.output,
        input_size=input_size, policy=Path(args.policy) if args.policy else None,
    ), progress=progress)
    for note in summary["notes"]:
        progress(f"note: {note}")
    policy = summary["policy"]
    installed = f"policy {policy['file']}: " + (
        policy["why"] if policy["recipe"] == policy["file"] else
        f"{policy['recipe']}, {policy['why']}" + ("" if args.policy else
                                                   "; --policy FILE installs another"))
    checked = None
    if args.check if args.check is not None else args.model_file is not None:
        checked = _check_installed_policy(home)
        summary["policy_check"] = checked.to_dict()
    shape = "x".join(map(str, summary["input_shape"]))
    emit(args, summary, "\n".join(
        [f"initialised {summary['home']}: {summary['model']} v{summary['version']} "
         f"({summary['param_count']:,} parameters, input {shape} in {summary['input_scale']}, "
         f"output {summary['output']}, weights {summary['weights']}), "
         f"{summary['validation_samples']} validation images, "
         f"{summary['replay_samples']} replay images, "
         f"{summary['reference_samples']} reference images", installed]
        + ([checked.message] if checked else [])))
    return 0


def _check_installed_policy(home: Home) -> PolicyCheck:
    """Run ``policy check`` on a new home's installed policy (``check.check_policy``)."""
    from odtd.policy import load_policy
    from odtd.session.check import check_policy

    config = home.load_config()
    store = home.open_store()
    try:
        return check_policy(home, store, config, load_policy(home.policy_path(config)), progress)
    finally:
        store.close()


@command("ingest")
def cmd_ingest(args: argparse.Namespace) -> int:
    """Ingest images as pending samples, or with ``--unlabelled`` as unlabelled ones."""
    from odtd.home.ingest import Ingestor, discover, discover_unlabelled

    home = home_of(args)
    day = _check_day(args.day)
    if args.unlabelled and args.label:
        raise ConfigError("ingest: --label names the images' class, --unlabelled says they have "
                          "none: give one of them")
    files = discover_unlabelled(Path(args.path)) if args.unlabelled else \
        discover(Path(args.path), args.label)
    store = home.open_store()
    try:
        ingestor = Ingestor.for_home(home, store)
        show = None if args.json or len(files) < 500 else \
            (lambda done, total: progress(f"ingested {done}/{total}"))
        report = ingestor.ingest(files, day=day, progress=show)
    finally:
        store.close()
    data = report.as_dict()
    notes = [] if args.unlabelled else [f"{report.holdout} held out for evaluation"]
    if report.unlabelled or args.unlabelled:
        notes.append(f"{report.unlabelled} unlabelled")
    if report.labelled_later:
        notes.append(f"{report.labelled_later} stored unlabelled before, labelled now")
    lines = [f"accepted {report.accepted} ({'; '.join(notes)}), "
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
                       "Version 0 is a built-in network (--model) or your own Keras classifier "
                       "(--model-file: read without running any code in it; Lambda layers and "
                       "custom objects are refused). The policy installed is --policy FILE, or: "
                       "for --model-file the recipe for a model on a new camera "
                       "(policies/new-camera.yaml; new-camera-no-batchnorm.yaml for a model "
                       "without BatchNormalization), for a built-in network its own recipe where "
                       "it has one (policies/<model>.yaml), else policies/default.yaml; without "
                       "--policy an existing policy file is kept. With --model-file, a few "
                       "steps of the policy train on the --replay (or --validation) images "
                       "first (`odtctl policy check`), and a loss that diverges or rises is "
                       "reported with the fix.")
    p.add_argument("--model", help="a built-in network (see `odtctl models`)")
    p.add_argument("--input-size", metavar="HxW",
                   help="with --model: the network's input, HEIGHTxWIDTH in pixels or N for NxN "
                        "(default and least: 32x32, xception's 71x71; densenet40 and tinycnn "
                        "take down to 4x4); with --model-file: the size of a model whose input "
                        "has none (keras.Input((None, None, 3))); images are fitted to it")
    p.add_argument("--model-file", metavar="FILE",
                   help="your own trained Keras image classifier, a .keras archive or an .h5 file")
    p.add_argument("--name", help="with --model-file: the model's name in the home (default: the "
                                  "file's name, with -imported if a built-in network has it)")
    p.add_argument("--input-scale", choices=["0-255", "0-1", "-1-1"],
                   help="with --model-file: the pixels the model takes (default 0-255, as "
                        "keras.utils.image_dataset_from_directory gives them to a model that "
                        "holds its own Rescaling layer)")
    p.add_argument("--output", choices=["softmax", "logits"],
                   help="with --model-file: what the last layer gives (default: read from it)")
    p.add_argument("--weights",
                   help="with --model: starting weights (.npz from `odtctl models export`); "
                        "default: fresh init")
    p.add_argument("--classes", help="comma-separated class names (default: the ten CIFAR-10 classes)")
    p.add_argument("--validation", help="directory of <label>/<image> files: the fixed validation set")
    p.add_argument("--replay", help="directory of <label>/<image> files the base model was trained on: "
                   "they seed the replay buffer")
    p.add_argument("--reference-every", type=int, default=REFERENCE_EVERY, metavar="N",
                   help="hold every Nth --replay image out as the reference set: the original "
                        "domain, which a candidate must not forget (acceptance.reference_tolerance); "
                        f"0 = none (default {REFERENCE_EVERY})")
    p.add_argument("--force", action="store_true", help="replace an existing home (deletes its state)")
    p.add_argument("--policy", metavar="FILE",
                   help="the policy to install (validated first; replaces the home's policy "
                        "file); default: the recipe for the model")
    p.add_argument("--check", action="store_true", default=None,
                   help="train a few steps of the installed policy before the first night and "
                        "report a loss that diverges or rises (`odtctl policy check`); the "
                        "default with --model-file")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="do not check the installed policy")

    p = sub.add_parser("ingest", parents=[reader], help="add images as pending samples",
                       description="Add images: a file (with --label), a <label>/<file> directory "
                                   "(its _unlabelled/ folder's images without a label), or a CSV "
                                   "manifest 'path,label'; with --unlabelled, images without a "
                                   "label. Bad files are quarantined.")
    p.add_argument("path", help="image file, directory or .csv manifest")
    p.add_argument("--label", help="label for a single file (or loose files in a directory)")
    p.add_argument("--unlabelled", action="store_true",
                   help="PATH is images without a label (a folder, walked to any depth, or one "
                        "image): stored as unlabelled samples, counted apart, never evaluated on; "
                        "read only where the policy asks (training.prior_correction: the class "
                        "priors; training.pseudo_labels: trained on where the model is sure); "
                        "the same image ingested later with a label becomes a labelled sample")
    p.add_argument("--day", help="YYYY-MM-DD the samples belong to (default: today)")
