"""``odtctl models``: the catalogue, a home's versions, rollback, export."""

from __future__ import annotations

import argparse
from pathlib import Path

from odtd.cli.output import command, emit, home_of, progress
from odtd.errors import ConfigError
from odtd.table import table


@command("models")
def cmd_models(args: argparse.Namespace) -> int:
    """List the model registry, or a home's versions; roll back; export."""
    from odtd.trainer.protocol import catalog

    action = args.action or "list"
    if action == "list":
        rows = [{"name": info.name, "description": info.description,
                 "input_shape": list(info.input_shape),
                 "param_count": catalog.param_count(name, 10)}
                for name, info in catalog.MODELS.items()]
        text = "\n".join(table(((r["name"], f"{r['param_count']:,}", r["description"])
                                for r in rows), ("model", "parameters (10 classes)", "description"),
                               align="<>"))
        emit(args, rows, text)
        return 0
    from odtd.home import versions

    home = home_of(args)
    store = home.open_store()
    try:
        if action == "versions":
            rows = versions.list_versions(home, store)
            from odtd.report.status import pct

            text = "\n".join(table(
                (("*" if r["current"] else "", f"v{r['version']}", r["parent"], r["session_id"],
                  pct(r["accuracy"]), r["state"], r["sha256"][:12], r["created_at"]) for r in rows),
                ("", "version", "parent", "session", "accuracy", "state", "sha256", "created"),
                align="<>>>>"))
            emit(args, rows, text)
        elif action == "rollback":
            result = versions.rollback(home, store, _version_arg(args))
            emit(args, result, f"{result['model']} v{result['version']} is current "
                               f"(was v{result['previous']})")
        elif action == "export":
            if not args.out:
                raise ConfigError("models export: --out FILE is required (.keras or .h5: a full "
                                  "Keras model; .npz: odtd's weights)")
            version = _version_arg(args)
            if not args.out.endswith(".npz"):
                progress(f"exporting v{version} to {args.out} (a worker builds the Keras model) ...")
            result = versions.export(home, store, version, Path(args.out), as_given=args.as_given)
            priors = result["logit_offset"]
            emit(args, result, f"exported {result['model']} v{result['version']} to {result['out']} "
                               f"(sha256 {result['sha256'][:12]})"
                               + (f"; the device's class priors: {priors}" if priors else ""))
    finally:
        store.close()
    return 0


def _version_arg(args: argparse.Namespace) -> int:
    text = (args.version or "").lstrip("v")
    if not text.isdigit():
        raise ConfigError(f"models {args.action}: VERSION {args.version!r} must be a number like 3 or v3")
    return int(text)


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
                reader: argparse.ArgumentParser) -> None:
    """Add ``models``."""
    p = sub.add_parser("models", parents=[reader], help="model registry, versions, rollback, export",
                       description="With no action: the registry with parameter counts. "
                                   "versions | rollback VERSION | export VERSION --out FILE "
                                   "(.keras or .h5: a full Keras model that keras.models.load_model "
                                   "opens without odtd; .npz: odtd's weights)")
    p.add_argument("action", nargs="?", choices=["list", "versions", "rollback", "export"])
    p.add_argument("version", nargs="?", help="version number for rollback/export (e.g. 3 or v3)")
    p.add_argument("--out", help="export: FILE.keras or FILE.h5 (a full Keras model, written by the "
                                 "device's Keras), or FILE.npz")
    p.add_argument("--as-given", action="store_true",
                   help="export of an imported model: write the weights into a copy of the file "
                        "given to init, which the Keras that wrote it opens (e.g. a server on "
                        "Keras 3 when the device runs Keras 2)")
