"""``odtctl simulate``: days of the daily cycle through the real session path."""

from __future__ import annotations

import argparse

from odtd.cli.output import command, emit, home_of, progress


@command("simulate")
def cmd_simulate(args: argparse.Namespace) -> int:
    """Run N days of the daily cycle through the real session path."""
    from odtd.sim.simulate import SimulationOptions, simulate

    options = SimulationOptions(
        days=args.days, per_day=args.per_day, model=args.model, dataset=args.dataset,
        pretrain_samples=args.pretrain_samples, pretrain_epochs=args.pretrain_epochs,
        validation_samples=args.validation_samples, fresh=args.fresh, seed=args.seed,
        policy=args.policy, shift=args.shift, priors=args.priors, stream=args.stream,
        unlabelled=args.unlabelled,
    )
    result = simulate(home_of(args), options, progress=progress)
    emit(args, result, None if args.json else "\n".join(result["table"]))
    return 0


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
                reader: argparse.ArgumentParser) -> None:
    """Add ``simulate``."""
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
    p.add_argument("--priors", metavar="dirichlet:ALPHA",
                   help="the device sees the classes unevenly: its mix a Dirichlet draw of "
                        "concentration ALPHA (fixed per --seed; small: a few classes); needs --dataset")
    p.add_argument("--stream", metavar="runs:MEAN",
                   help="the device's images arrive in runs of one class of mean length MEAN, in "
                        "order and across days; needs --dataset")
    p.add_argument("--unlabelled", type=int, default=0, metavar="K",
                   help="K more images a day without labels, from the same camera and mix, "
                        "ingested as unlabelled samples (read by training.prior_correction); "
                        "needs --dataset")
    p.add_argument("--shift", metavar="NAME",
                   help="the device's camera differs from the server's: a named camera shift "
                        "('--shift help' lists them), your own (FILE.py:NAME, a function of a "
                        "uint8 batch and a numpy Generator) or several in turn (A+B), applied to "
                        "the daily images and the validation set, never to pre-training; chosen "
                        "when the home is created")
