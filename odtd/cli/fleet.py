"""``odtctl fleet``: a Flower fleet's server side (docs/fleet.md).

``status`` reads the server's record (standard library only), ``plot`` draws it (matplotlib);
``run`` submits odtd's Flower app to a SuperLink with ``flwr run`` and ``simulate`` runs a fleet
on this machine; both need the ``fleet`` extra (``pip install 'odtd[fleet]'``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from pathlib import Path
from typing import Any, Optional

from odtd.cli.output import command, emit, progress
from odtd.errors import OdtdError
from odtd.report.fleet_plot import round_mean


def _figure(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def status_table(report: dict[str, Any]) -> str:
    """The text form of ``fleet status``: one line a round, then each device that did not train.

    ``global``: the round's model on the devices' own samples, where an evaluate round scored it.
    """
    run = report["run"]
    span = report if run is None else run  # every run's (``--all``): the first's start, the last's end
    lines = [f"{report['label']}" + (", the first" if run is None else "") + f" started "
             f"{span['started_at']}, " + ("the last " if run is None else "")
             + (f"finished {span['finished_at']}" if span["finished_at"] else "not finished"),
             f"{'round':>5} {'asked':>5} {'trained':>7} {'declined':>8} {'silent':>6} "
             f"{'acc before':>10} {'acc after':>9} {'global':>6} {'joules':>8} {'seconds':>7} "
             f"{'outside':>7} {'flower':>6}"]
    for r in report["rounds"]:
        evaluated = (r.get("evaluation") or {}).get("metrics") or {}
        lines.append(f"{r['round']:>5} {r['asked']:>5} {r['trained']:>7} {r['declined']:>8} "
                     f"{r['no_reply']:>6} {_figure(round_mean(r, 'accuracy-before'), '10.3f')} "
                     f"{_figure(round_mean(r, 'accuracy-after'), '9.3f')} "
                     f"{_figure(evaluated.get('accuracy'), '6.3f')} {_figure(r['joules'], '8.1f')} "
                     f"{r['seconds']:>7.1f} {_figure(r['outside_share'], '7.1%')} "
                     f"{_figure(r.get('flower_share'), '6.1%')}")
    for r in report["rounds"]:
        for device in r["devices"]:
            if device["outcome"] != "trained":
                lines.append(f"round {r['round']}: device {device['node_id']} {device['outcome']}: "
                             f"{device['reason']}")
    return "\n".join(lines)


def run_report(record: Path, run_id: Optional[str], every: bool = False) -> dict[str, Any]:
    """A run's rounds from the server's record (the latest run without ``run_id``).

    With ``every``, every run's rounds (``RoundLog.every_round``), and ``run`` None. ``label``
    names what the report holds (``run ID``, or ``N runs``) for its title.

    Raises:
        StoreError: no record file there.
        OdtdError: no such run, or no run yet.
    """
    from odtd.fleet.rounds import RoundLog

    log = RoundLog.open_existing(record)
    try:
        runs = log.runs()
        chosen = [r for r in runs if run_id is None or r["run_id"] == run_id]
        if not chosen:
            raise OdtdError(f"{record}: " + (f"no run {run_id}" if run_id else "no run yet")
                            + "; `odtctl fleet status --record FILE --json` lists what it holds")
        report = {"record": str(record), "runs": [r["run_id"] for r in runs]}
        if every:
            return dict(report, run=None, label=f"{len(runs)} runs", rounds=log.every_round(),
                        started_at=runs[-1]["started_at"], finished_at=runs[0]["finished_at"])
        run = chosen[0]
        return dict(report, run=run, label=f"run {run['run_id']}",
                    rounds=[r.to_dict() for r in log.rounds(run["run_id"])])
    finally:
        log.close()


def fleet_status(args: argparse.Namespace) -> int:
    """Show a run's rounds from the server's record."""
    report = run_report(Path(args.record), args.run, args.all)
    emit(args, report, None if args.json else status_table(report))
    return 0


def fleet_plot(args: argparse.Namespace) -> int:
    """Draw a run's rounds from the server's record into a PNG."""
    from odtd.report.fleet_plot import plot_rounds

    report = run_report(Path(args.record), args.run, args.all)
    out = plot_rounds(report, Path(args.out))
    emit(args, {"out": str(out), "run": report["run"] and report["run"]["run_id"],
                "rounds": len(report["rounds"])},
         f"wrote {out} ({report['label']}, {len(report['rounds'])} rounds)")
    return 0


def fleet_run(args: argparse.Namespace) -> int:
    """Submit odtd's Flower app to a SuperLink and follow it to the end."""
    if importlib.util.find_spec("flwr") is None:  # found, not imported: the CLI stays Flower-free
        raise OdtdError("fleet run needs Flower: pip install 'odtd[fleet]' (Python >= 3.11)")
    from odtd.fleet.launch import run_app
    from odtd.fleet.settings import load_settings

    settings = load_settings(Path(args.config))  # its errors before Flower starts anything
    work = Path(args.work or settings.record.with_name(settings.record.stem + "-flower"))
    status = run_app(Path(args.config), work, args.superlink, insecure=args.insecure,
                     root_certificates=Path(args.root_certificates) if args.root_certificates else None,
                     progress=progress)
    if status != 0:
        raise OdtdError(f"flwr run exited with status {status}; its log: {work / 'flwr-run.log'}")
    print(f"recorded in {settings.record} (odtctl fleet status --record {settings.record})")
    return 0


def fleet_simulate(args: argparse.Namespace) -> int:
    """N devices, their days and rounds on this machine; a table at the end."""
    if importlib.util.find_spec("flwr") is None:
        raise OdtdError("fleet simulate needs Flower: pip install 'odtd[fleet]' (Python >= 3.11)")
    from odtd.fleet.simulate import FleetSimulation, simulate_fleet
    from odtd.sim.simulate import SimulationOptions

    each = SimulationOptions(
        days=args.rounds, per_day=args.per_day, model=args.model, dataset=args.dataset,
        pretrain_samples=args.pretrain_samples, pretrain_epochs=args.pretrain_epochs,
        validation_samples=args.validation_samples, seed=args.seed, policy=args.policy,
        shift=args.shift)
    options = FleetSimulation(devices=args.devices, alpha=args.alpha, test_per_device=args.test_images,
                              local_epochs=args.local_epochs, learning_rate=args.learning_rate,
                              batchnorm=args.batchnorm,
                              model_file=args.model_file, replay_seed=args.replay_seed,
                              strategy=args.strategy, proximal_mu=args.proximal_mu,
                              server_learning_rate=args.server_learning_rate,
                              server_momentum=args.server_momentum,
                              device_validation=args.device_validation, each=each)
    result = simulate_fleet(Path(args.out), options, progress=progress)
    result["plot"] = _plot_simulation(result, Path(args.out))
    emit(args, result, None if args.json else "\n".join(
        result["table"] + [f"plot: {result['plot']}" if result["plot"] else "plot: none "
                           "(pip install 'odtd[plot]')",
                           f"rounds: odtctl fleet status --record {Path(args.out) / 'rounds.db'} --all"]))
    return 0


def _plot_simulation(result: dict[str, Any], out: Path) -> Optional[str]:
    """Write ``fleet simulate``'s plots: ``fleet.png`` (the arms per device), ``rounds.png``.

    Returns:
        ``fleet.png``'s path; None without matplotlib (the table stands alone).
    """
    if importlib.util.find_spec("matplotlib") is None:
        return None
    from odtd.report.fleet_plot import plot_arms_per_device, plot_rounds

    # One `flwr run` a day, of one round each: the rounds are numbered by day (``every_round``).
    plot_rounds({"label": f"simulated in {out}", "rounds": result["rounds"]}, out / "rounds.png")
    return str(plot_arms_per_device(result, out / "fleet.png"))


@command("fleet")
def cmd_fleet(args: argparse.Namespace) -> int:
    """Dispatch ``fleet status | run | simulate``."""
    return {"status": fleet_status, "plot": fleet_plot, "run": fleet_run,
            "simulate": fleet_simulate}[args.fleet_command](args)


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
                reader: argparse.ArgumentParser) -> None:
    """Add ``fleet status``, ``plot``, ``run`` and ``simulate``."""
    p = sub.add_parser("fleet", help="a Flower fleet: run rounds, show them (docs/fleet.md)",
                       description="The server side of a Flower fleet whose devices run odtd.")
    fleet_sub = p.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    run = argparse.ArgumentParser(add_help=False)  # which run of which record
    run.add_argument("--record", required=True, help="the server's record (the YAML's `record`)")
    which = run.add_mutually_exclusive_group()
    which.add_argument("--run", help="a run id (default: the latest)")
    which.add_argument("--all", action="store_true",
                       help="every run's rounds, the oldest first, numbered on "
                            "(`fleet simulate` starts one run a day)")
    fleet_sub.add_parser("status", parents=[reader, run], help="a run's rounds from the server's record",
                         description="Show each round of a run: devices asked, trained, declined "
                                     "(and why), aggregated accuracy, joules, round time.")
    d = fleet_sub.add_parser("plot", parents=[reader, run], help="a run's rounds as a PNG",
                             description="Draw each round of a run into a PNG: devices trained, "
                                         "declined and silent; accuracy before and after on their "
                                         "hold-outs; the round's time (sessions, the devices' "
                                         "set-up, Flower's part); joules.")
    d.add_argument("--out", default="fleet-rounds.png", help="the PNG to write (default fleet-rounds.png)")
    r = fleet_sub.add_parser("run", parents=[common], help="run rounds on a SuperLink (flwr run)",
                             description="Submit odtd's Flower app to a SuperLink with `flwr run`; "
                                         "progress per round; each round goes to the YAML's record.")
    r.add_argument("config", help="the server's YAML (docs/fleet.md)")
    r.add_argument("--superlink", default="127.0.0.1:8000", help="the SuperLink's host:port")
    tls = r.add_mutually_exclusive_group()
    tls.add_argument("--insecure", action="store_true", help="no TLS (a SuperLink on localhost)")
    tls.add_argument("--root-certificates", help="the CA certificate that signed the SuperLink's")
    r.add_argument("--work", help="where the app's directory and Flower's files go "
                                  "(default: beside the record)")
    m = fleet_sub.add_parser("simulate", parents=[reader], help="N devices and their rounds on this machine",
                             description="N homes from one base model, each its own class mix "
                                         "(Dirichlet) and camera, a day of new images and a Flower "
                                         "round a day through a real SuperLink, SuperNodes and "
                                         "daemons; beside them each device alone and AdaBN on the "
                                         "same images; every arm scored on each device's own test "
                                         "images at the end.")
    m.add_argument("--devices", type=int, default=3, help="devices (default 3)")
    m.add_argument("--rounds", type=int, default=2, help="days, one round each (default 2)")
    m.add_argument("--per-day", type=int, default=64, help="new images a device gets a day (default 64)")
    m.add_argument("--alpha", type=float, default=0.5,
                   help="Dirichlet concentration of the devices' class mixes (default 0.5)")
    m.add_argument("--shift", metavar="NAME", help="one camera shift for every device "
                                                   "(`odtctl simulate --shift help` lists them)")
    m.add_argument("--model", default="tinycnn", help="the base model's network (default tinycnn)")
    m.add_argument("--model-file", help="a trained Keras model (.keras/.h5) as the base, imported "
                                        "as `odtctl init --model-file` does (no pre-training)")
    m.add_argument("--dataset", default="synthetic",
                   help="'synthetic' (built in) or a <split>/<class>/*.jpg directory or CIFAR-10 .tar.gz")
    m.add_argument("--pretrain-samples", type=int, default=1000, help="server images the base "
                                                                      "model pre-trains on (default 1000)")
    m.add_argument("--pretrain-epochs", type=int, default=3, help="pre-training epochs (default 3)")
    m.add_argument("--validation-samples", type=int, default=200, help="each home's validation set")
    m.add_argument("--test-images", type=int, default=200, help="test images a device (default 200)")
    m.add_argument("--device-validation", type=int, default=0, metavar="N",
                   help="each device's validation set its own: N test images of its class mix, "
                        "shifted like its camera (default 0: the base's, shared)")
    m.add_argument("--replay-seed", type=int, default=500,
                   help="the base model's own clean images each home gets as `init --replay` "
                        "(every tenth is the reference set guarding the clean domain; default 500)")
    m.add_argument("--local-epochs", type=int,
                   help="each device's epochs a round (default: its policy's, as alone)")
    m.add_argument("--learning-rate", type=float,
                   help="each device's learning rate in a round (default: its policy's, as alone)")
    m.add_argument("--batchnorm", choices=("fedavg", "fedbn"), default="fedavg",
                   help="BatchNorm parameters averaged (fedavg) or kept per device (fedbn)")
    m.add_argument("--strategy", choices=("fedavg", "fedavgm", "fedprox"), default="fedavg",
                   help="the server's strategy (default fedavg; fedavgm: its step is "
                        "--server-learning-rate, its momentum --server-momentum)")
    m.add_argument("--server-learning-rate", type=float, default=1.0,
                   help="fedavgm: the global model moves this many times the devices' mean "
                        "update (default 1: FedAvg's; BatchNorm's statistics are averaged)")
    m.add_argument("--server-momentum", type=float, default=0.0,
                   help="fedavgm: the server's momentum, carried from each day's round to the "
                        "next (default 0)")
    m.add_argument("--proximal-mu", type=float, default=0.01,
                   help="fedprox: the proximal term's weight in each device's loss (default 0.01)")
    m.add_argument("--policy", help="the devices' policy file (default: the model's recipe)")
    m.add_argument("--seed", type=int, default=0, help="seed of the draws")
    m.add_argument("--out", required=True, help="a new directory for the homes, logs and record")
