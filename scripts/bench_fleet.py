#!/usr/bin/env python3
"""The fleet's goals (issue 54; docs/fleet.md), from one `odtctl fleet simulate` run. Prints JSON.

The issue's size: 8 devices, DenseNet40 imported with ``--model-file`` as a user would, one shared
camera shift (dusk), Dirichlet alpha 0.5, 64 new images a day each, 6 rounds:

    python scripts/bench_fleet.py --devices 8 --rounds 6 --shift dusk --alpha 0.5 \\
        --model-file densenet40.keras --out /tmp/bench-fleet

Goals, each with the figure it is judged on:
- federated odtd beats each device alone on the devices' own (shifted) test images by more than
  2 standard errors of the paired difference over devices;
- it beats AdaBN there by at least 5 points;
- no device serves a model below its day 0 (the base), on its own images or clean ones, on any
  day (``odtd.fleet.daily``: every day's served version of each device's fleet home scored
  after the run; ``--days-of DIR`` does only that, for a run already made with these options);
- joules per device per round reported; Flower's messaging and aggregation under 5% of a round
  (``flower_share``: the round outside the longest device's whole part, ``device-seconds``;
  ``outside_share`` also counts the devices' own set-up around their sessions).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from odtd.errors import OdtdError
from odtd.fleet.daily import score_days
from odtd.fleet.simulate import FleetSimulation, simulate_fleet
from odtd.sim.simulate import SimulationOptions

REPO = Path(__file__).resolve().parents[1]


def goals(result: dict, daily: dict) -> dict:
    """The issue's goals judged on a simulation's result and its days' scores."""
    domain = result["domain"]
    rows = result["devices"]

    def points(arm: str, other: str, where: str = domain) -> np.ndarray:
        return np.array([100 * (r["accuracy"][arm][where] - r["accuracy"][other][where]) for r in rows])

    def paired(diff: np.ndarray) -> dict:
        se = float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else None
        return {"mean_points": round(float(diff.mean()), 2),
                "se_points": None if se is None else round(se, 2)}

    alone, adabn = paired(points("fleet", "alone")), paired(points("fleet", "adabn"))
    below = sorted({device for device, arm, _, _ in daily["below_day0"] if arm == "fleet"})
    alone_below = sorted({device for device, arm, _, _ in daily["below_day0"] if arm == "alone"})
    trained = [r for r in result["rounds"] if r["trained"]]
    per_device = [r["joules"] / r["trained"] for r in trained if r["joules"] is not None]
    outside = [r["outside_share"] for r in trained if r["outside_share"] is not None]
    flower = [r["flower_share"] for r in trained if r.get("flower_share") is not None]
    return {
        "fleet_vs_alone": {**alone, "met": alone["se_points"] is not None
                           and alone["mean_points"] > 2 * alone["se_points"]},
        "fleet_vs_adabn": {**adabn, "met": adabn["mean_points"] >= 5},
        "devices_serving_below_day0": {"devices": below, "met": not below,
                                       "days": [d for d in daily["below_day0"] if d[1] == "fleet"],
                                       "alone_for_comparison": alone_below},
        "joules_per_device_per_round": round(float(np.mean(per_device)), 1) if per_device else None,
        # The goal: Flower's messaging and aggregation, the round outside the devices' parts.
        "flower_share": {"per_round": flower, "mean": round(float(np.mean(flower)), 4) if flower
                         else None, "met": bool(flower) and max(flower) < 0.05},
        # Also outside the sessions: the devices' own set-up (the daemon's task, the weights files).
        "outside_share": {"per_round": outside, "mean": round(float(np.mean(outside)), 4) if outside
                          else None},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="a new directory for the run (required without --days-of)")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-day", type=int, default=64)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--shift", default="dusk")
    parser.add_argument("--model", default="tinycnn", help="without --model-file: pre-trained here")
    parser.add_argument("--model-file", help="the user's trained Keras model, imported")
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--pretrain-samples", type=int, default=1000)
    parser.add_argument("--pretrain-epochs", type=int, default=3)
    parser.add_argument("--test-images", type=int, default=200)
    parser.add_argument("--local-epochs", type=int,
                        help="each device's epochs a round (the server's; default: its policy's)")
    parser.add_argument("--learning-rate", type=float,
                        help="each device's rate in a round (the server's; default: its policy's)")
    parser.add_argument("--batchnorm", choices=("fedavg", "fedbn"), default="fedavg")
    parser.add_argument("--strategy", choices=("fedavg", "fedavgm", "fedprox"), default="fedavg")
    parser.add_argument("--proximal-mu", type=float, default=0.01)
    parser.add_argument("--server-learning-rate", type=float, default=1.0,
                        help="fedavgm: the server's step on the devices' mean update")
    parser.add_argument("--server-momentum", type=float, default=0.0,
                        help="fedavgm: the server's momentum, carried from day to day")
    parser.add_argument("--replay-seed", type=int, default=500,
                        help="clean images each home gets as init --replay (the reference set)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", help="the devices' policy file (default: the model's recipe)")
    parser.add_argument("--device-validation", type=int, default=0, metavar="N",
                        help="each device's validation set: N test images of its own class mix "
                             "(default 0: the base's, shared)")
    parser.add_argument("--days-of", metavar="DIR",
                        help="only score every day's served models of the run in DIR (made with "
                             "these options) and print them")
    args = parser.parse_args()
    each = SimulationOptions(days=args.rounds, per_day=args.per_day, model=args.model,
                             dataset=args.dataset, pretrain_samples=args.pretrain_samples,
                             pretrain_epochs=args.pretrain_epochs, validation_samples=200,
                             seed=args.seed, shift=args.shift, policy=args.policy)
    options = FleetSimulation(devices=args.devices, alpha=args.alpha, test_per_device=args.test_images,
                              local_epochs=args.local_epochs, learning_rate=args.learning_rate,
                              batchnorm=args.batchnorm, model_file=args.model_file,
                              replay_seed=args.replay_seed, strategy=args.strategy,
                              proximal_mu=args.proximal_mu,
                              server_learning_rate=args.server_learning_rate,
                              server_momentum=args.server_momentum,
                              device_validation=args.device_validation, each=each)
    def log(line: str) -> None:
        print(line, file=sys.stderr)

    # The code a run measures is the code it started with (Flower's processes import odtd afresh).
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or None
    if not args.days_of and not args.out:
        parser.error("--out DIR is required (a new directory for the run)")
    try:
        if args.days_of:
            print(json.dumps(score_days(Path(args.days_of), options, log), indent=2))
            return 0
        result = simulate_fleet(Path(args.out), options, progress=log, every_day=True)
    except OdtdError as exc:  # bad options or data, a run that failed: one line, as odtctl says it
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    daily = result["days_scored"]
    machine = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), None)
    print(json.dumps({"machine": machine, "commit": commit, "options": vars(args),
                      "goals": goals(result, daily), "scale": result["scale"], "days": daily,
                      "fleet_minus_alone": result["fleet_minus_alone"], "devices": result["devices"],
                      "rounds": result["rounds"], "table": result["table"]}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
