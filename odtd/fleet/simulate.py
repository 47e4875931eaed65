"""``odtctl fleet simulate``: N devices on one machine, through Flower's real processes.

N homes start from one pre-trained base model (``odtd.sim.simulate``'s pre-training). Each device
gets its own corner of the world: its class mix is a Dirichlet draw (``alpha``: small, a few
classes; large, all alike), and optionally every camera is shifted the same way (``shift``).
Each day every device gets ``per_day`` new labelled images of its mix, and the fleet runs one
round: a SuperLink, one daemon and one SuperNode per device, and ``flwr run`` of odtd's
ServerApp for one round from the last day's global weights. Beside each federated device, on
the same days and images: the device learning alone (odtd as today: its own home, the same
session path) and AdaBN (the base model's BatchNorm statistics re-estimated on the images the
device saw). At the end every arm's model on each device is scored on that device's test
images (drawn with its class mix, shifted like its camera) and on the same images clean.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date, timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from odtd.daemon.control import request
from odtd.errors import ConfigError, DaemonUnavailable, OdtdError
from odtd.fleet.launch import LocalFleet
from odtd.fleet.rounds import RoundLog
from odtd.home.create import InitRequest, init_home
from odtd.home.ingest import Ingestor, discover
from odtd.home.paths import Home
from odtd.home.spec import ModelSpec
from odtd.home.versions import ModelRepo
from odtd.policy import load_policy
from odtd.session.runner import SessionRunner
from odtd.sim import datasets
from odtd.sim.arms import Day, Trial, link_home
from odtd.sim.controls import AdaBnArm
from odtd.sim.scoring import ScoringSets
from odtd.sim.simulate import DataSource, SimulationOptions, install_policy, pretrain_base
from odtd.trainer.protocol.procfs import read_proc_mb

ARMS = ("base", "alone", "adabn", "fleet")


@dataclass
class FleetSimulation:
    """What ``odtctl fleet simulate`` runs (see its ``--help``).

    Attributes:
        devices: How many devices.
        alpha: The Dirichlet concentration of their class mixes.
        test_per_device: Test images of each device's mix.
        local_epochs: Each device's epochs a round; None: its policy's, as the device alone
            trains (so the arms differ only in where a round starts).
        learning_rate: The devices' rate in a round (the server's ``learning_rate``); None:
            each policy's, as alone.
        batchnorm: ``fedavg`` or ``fedbn`` (docs/fleet.md).
        strategy: The server's (``fedavg``, ``fedavgm``, ``fedprox``; ``proximal_mu`` for
            FedProx), as the server's YAML names it.
        server_learning_rate: FedAvgM's step: the global model moves this many times the
            devices' mean update (BatchNorm's statistics: their mean).
        server_momentum: FedAvgM's momentum. Each day's round is a Flower run of its own; the
            server writes its momentum beside the day's global weights and the next day's run
            takes it up (``odtd.fleet.server.resume_momentum``), so the days step as one run.
        model_file: A user's trained Keras model (``.keras``/``.h5``) as the base, imported as
            ``odtctl init --model-file`` does (no pre-training); None: ``each.model`` pre-trained.
        replay_seed: The base model's own (clean, server-side) images every home gets as
            ``init --replay``: its replay seed, every tenth held out as the reference set that
            guards the clean domain. 0: none (no reference guard).
        device_validation: Each device's validation set its own: this many test images of its
            class mix, shifted like its camera, in place of the base's shared one (the guard,
            and ``training.prior_correction``, then judge on the device's world); 0: shared.
        each: What every device shares with ``odtctl simulate``: its ``days`` are the rounds,
            ``per_day``, the model, data set, shift, pre-training, validation set, policy, seed.
    """

    devices: int = 3
    alpha: float = 0.5
    test_per_device: int = 200
    local_epochs: Optional[int] = None
    learning_rate: Optional[float] = None
    batchnorm: str = "fedavg"
    model_file: Optional[str] = None
    replay_seed: int = 500
    strategy: str = "fedavg"
    proximal_mu: float = 0.01
    server_learning_rate: float = 1.0
    server_momentum: float = 0.0
    device_validation: int = 0
    each: SimulationOptions = field(default_factory=lambda: SimulationOptions(
        days=2, pretrain_samples=1000, pretrain_epochs=3, validation_samples=200))


class DevicePools:
    """The devices' images: each device's class mix, its days and its test images.

    Synthetic images are generated per class as needed; a labelled data set's come from its
    train split (days) and test split (tests), each image given to one device only.
    """

    def __init__(self, options: FleetSimulation, source: DataSource) -> None:
        self.options, self.source = options, source
        self.classes = source.classes
        self.seed = options.each.seed
        rng = np.random.default_rng(self.seed)
        self.mix = rng.dirichlet([options.alpha] * len(self.classes), size=options.devices)
        self._rng = rng
        self._next = {"train": 0, "test": 0}
        if source.dataset is not None:
            self._free = {split: self._by_class(split) for split in ("train", "test")}

    def _by_class(self, split: str) -> Dict[int, List[int]]:
        files = self.source.dataset.files(split)
        order = self._rng.permutation(len(files))
        by_class: Dict[int, List[int]] = {c: [] for c in range(len(self.classes))}
        for index in order:
            by_class[files[index][1]].append(int(index))
        return by_class

    def check_plan(self) -> None:
        """Refuse, before anything is made, a run whose draws would use up a class of the data set.

        The run's draws in their order (every device's test images, its validation set, then each
        day's images), counted on a copy of the draws' random state, so the run then draws the same.
        """
        if self.source.dataset is None:
            return
        options, rng = self.options, copy.deepcopy(self._rng)
        free = {split: np.array([len(self._free[split][c]) for c in range(len(self.classes))])
                for split in ("train", "test")}
        plan = [("test", options.test_per_device)] * options.devices
        if options.device_validation > 0:
            plan += [("test", options.device_validation)] * options.devices
        plan += [("train", options.each.per_day)] * (options.devices * options.each.days)
        for index, (split, n) in enumerate(plan):
            free[split] = free[split] - rng.multinomial(n, self.mix[index % options.devices])
            if free[split].min() < 0:
                self._too_few(split, int(free[split].argmin()))

    def _too_few(self, split: str, label: int) -> None:
        fewer = "--test-images, --device-validation" if split == "test" else "--rounds, --per-day"
        raise ConfigError(f"--dataset {self.options.each.dataset}: too few {split} images of "
                          f"{self.classes[label]} for {self.options.devices} devices; fewer "
                          f"--devices, {fewer} or a larger --alpha")

    def draw(self, device: int, n: int, split: str) -> tuple:
        """``n`` new images (x, y) of ``device``'s class mix from ``split`` (train or test)."""
        counts = self._rng.multinomial(n, self.mix[device])
        if self.source.dataset is None:
            xs, ys = [], []
            for label, count in enumerate(counts):
                if count:
                    x, y = self._synthetic_of(label, int(count), split)
                    xs.append(x)
                    ys.append(y)
            return np.concatenate(xs), np.concatenate(ys)
        indices = []
        for label, count in enumerate(counts):
            free = self._free[split][label]
            if len(free) < count:
                self._too_few(split, label)
            indices += [free.pop() for _ in range(int(count))]
        return self.source.dataset.load_arrays(split, np.array(indices))

    def _synthetic_of(self, label: int, count: int, split: str) -> tuple:
        """``count`` synthetic device-domain images of one class (fresh seeds, never repeated)."""
        xs: List[np.ndarray] = []
        while sum(len(x) for x in xs) < count:
            self._next[split] += 1
            seed = self.seed + (10_000 if split == "train" else 20_000) + 100 * self._next[split]
            x, y = datasets.synthetic(max(4 * count, 40) * len(self.classes) // 4, "device", seed=seed)
            xs.append(x[y == label])
        x = np.concatenate(xs)[:count]
        return x, np.full(len(x), label, dtype=np.int64)


def device_tests(options: FleetSimulation, source: DataSource, pools: DevicePools, trial: Trial,
                 device: int) -> ScoringSets:
    """Device ``device``'s test images: its class mix, shifted like its camera, and clean.

    Drawn first, for every device in turn, before any day's images: a run's test sets can be
    drawn again from its options alone (``odtd.fleet.daily``).
    """
    x, y = pools.draw(device, options.test_per_device, "test")
    shift = source.shift
    images = {"shifted": shift(x, seed=[options.each.seed, 10_000 + device]), "clean": x} if shift \
        else {"clean": x}
    return ScoringSets(trial, images, y, np.arange(len(y)), source.validation(), name=f"score-{device}")


def _own_validation(device: Dict[str, Any], options: FleetSimulation, source: DataSource,
                    pools: DevicePools, index: int) -> None:
    """Give the device's homes (fleet and alone) a validation set of its own class mix."""
    x, y = pools.draw(index, options.device_validation, "test")
    if source.shift:
        x = source.shift(x, seed=[options.each.seed, 20_000 + index])
    for arm in ("fleet", "alone"):
        path = device[arm].validation_file()
        path.unlink()  # a copy of the base's (link_home): replaced, not written through
        np.savez(path, x=x, y=y.astype(np.int64))


def _start_daemon(home: Home, log: Path) -> subprocess.Popen:
    """``odtd run`` on ``home``; returns once its control socket answers."""
    out = open(log, "w", encoding="utf-8")  # noqa: SIM115 - the process's log
    try:
        process = subprocess.Popen([sys.executable, "-m", "odtd.daemon.service", "run", "--home",
                                    str(home.root)], stdout=out, stderr=subprocess.STDOUT)
    finally:
        out.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise OdtdError(f"the daemon of {home.root} exited ({process.returncode}); see {log}")
        try:
            request(home.socket_path, "ping", timeout_s=2)
            request(home.socket_path, "pause", timeout_s=10)  # rounds only: no nightly session
            return process
        except (DaemonUnavailable, OdtdError, OSError):
            time.sleep(0.3)
    raise OdtdError(f"the daemon of {home.root} did not answer within 60 s; see {log}")


def _ingest(home: Home, x: np.ndarray, y: np.ndarray, classes: List[str], stamp: str) -> int:
    store = home.open_store()
    try:
        with tempfile.TemporaryDirectory(dir=home.runs) as tmp:
            datasets.write_image_folder(x, y, classes, Path(tmp), fmt="png")
            return Ingestor.for_home(home, store).ingest(discover(Path(tmp), None), day=stamp).accepted
    finally:
        store.close()


def _alone_session(home: Home, stamp: str) -> Dict[str, Any]:
    store = home.open_store()
    try:
        config = home.load_config()
        runner = SessionRunner(home, store, config, load_policy(home.policy_path(config)))
        return runner.run(trigger="simulate", day=stamp).to_dict()
    finally:
        store.close()


def _served(home: Home, model: str) -> Path:
    repo = ModelRepo(home.models, model)
    return repo.weights_path(repo.current())


def simulate_fleet(out: Path, options: FleetSimulation, progress: Callable[[str], None] = print,
                   every_day: bool = False) -> Dict[str, Any]:
    """Run the simulation in ``out`` (created; an existing one is refused) and return its result.

    ``every_day``: also score each day's served model of every device (``daily.score_days``,
    in the result's ``days_scored``); the last day's, scored for the table already, is not scored again.

    Raises:
        ConfigError: a bad count, an unknown shift or data set, too few images.
    """
    sim = options.each
    if options.devices < 1 or sim.days < 1 or sim.per_day < 1 or not options.alpha > 0 \
            or options.replay_seed < 0:
        raise ConfigError("--devices, --rounds and --per-day must be at least 1, --alpha above 0, "
                          "--replay-seed at least 0")
    if not options.server_learning_rate > 0:
        raise ConfigError(f"--server-learning-rate {options.server_learning_rate:g}: it must be above 0")
    if options.server_learning_rate != 1.0 and options.strategy != "fedavgm":
        raise ConfigError(f"--server-learning-rate {options.server_learning_rate:g} is FedAvgM's "
                          "server step: add --strategy fedavgm")
    if not 0 <= options.server_momentum < 1:
        raise ConfigError(f"--server-momentum {options.server_momentum:g}: it must be at least 0 "
                          "and below 1")
    if options.server_momentum and options.strategy != "fedavgm":
        raise ConfigError(f"--server-momentum {options.server_momentum:g} is FedAvgM's: add "
                          "--strategy fedavgm")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out}: not empty; give a new --out directory")
    source = DataSource(sim)
    pools = DevicePools(options, source)
    pools.check_plan()
    out.mkdir(parents=True, exist_ok=True)
    base = Home(out / "base")
    progress(f"creating the base model ({options.model_file or sim.model}) in {base.root} with "
             f"{options.replay_seed} replay seed images ...")
    with tempfile.TemporaryDirectory(dir=out) as seed_dir:
        if options.replay_seed > 0:
            x, y = source.server(options.replay_seed)
            datasets.write_image_folder(x, y, source.classes, Path(seed_dir), fmt="png")
        init_home(base, InitRequest(None if options.model_file else sim.model, source.classes,
                                    seed=sim.seed, validation_arrays=source.validation(),
                                    model_file=Path(options.model_file) if options.model_file else None,
                                    replay=Path(seed_dir) if options.replay_seed > 0 else None))
    if sim.policy:
        install_policy(base, Path(sim.policy))
    if sim.pretrain_samples > 0 and not options.model_file:
        pretrain_base(base, source, sim, progress)
    store = base.open_store()
    spec = ModelSpec.from_store(store)
    store.close()
    base_weights = _served(base, spec.name)
    shift = source.shift
    trial = Trial(spec.name, source.classes, spec.input_shape,
                  load_policy(base.policy_path(base.load_config())).training.precision,
                  out / "work", log=progress, model_keys=spec.job_keys(base))
    trial.work.mkdir()
    devices = []
    for i in range(options.devices):
        devices.append({
            "fleet": link_home(base.root, out / f"fleet-{i}"),
            "alone": link_home(base.root, out / f"alone-{i}"),
            "adabn": AdaBnArm(trial, base_weights, out / "work" / f"adabn-{i}.npz", batch_size=32),
            "tests": device_tests(options, source, pools, trial, i),
            "mix": [round(float(p), 3) for p in pools.mix[i]]})
        progress(f"device {i}: classes " + ", ".join(
            f"{source.classes[c]} {p:.0%}" for c, p in enumerate(pools.mix[i]) if p >= 0.05))
    if options.device_validation > 0:  # drawn after every device's test images (daily.py draws those again)
        for i, device in enumerate(devices):
            _own_validation(device, options, source, pools, i)
    local = LocalFleet(out / "flower")
    daemons: List[subprocess.Popen] = []
    days: List[Dict[str, Any]] = []
    try:
        local.start_superlink()
        for i, device in enumerate(devices):
            daemons.append(_start_daemon(device["fleet"], out / f"daemon-{i}.log"))
            local.start_supernode(device["fleet"].socket_path, f"supernode-{i}")
        global_weights = base_weights
        start = date.today()
        for r in range(1, sim.days + 1):
            stamp = (start + timedelta(days=r - 1)).isoformat()
            day: Dict[str, Any] = {"round": r, "alone": [], "adabn_j": []}
            for i, device in enumerate(devices):
                x, y = pools.draw(i, sim.per_day, "train")
                if shift is not None:
                    x = shift(x, seed=[sim.seed, 1 + r * options.devices + i])
                _ingest(device["fleet"], x, y, source.classes, stamp)
                _ingest(device["alone"], x, y, source.classes, stamp)
                session = _alone_session(device["alone"], stamp)
                day["alone"].append({k: session[k] for k in ("outcome", "reason", "energy_j",
                                                              "accuracy_before", "accuracy_after")})
                day["adabn_j"].append(device["adabn"].day(Day(r, stamp, [], x, y, shift is not None))
                                      ["energy_j"])
            progress(f"round {r}/{sim.days}: alone " + ", ".join(
                s["outcome"] for s in day["alone"]) + "; the fleet's round ...")
            config = out / f"fleet-round-{r}.yaml"
            config.write_text(json.dumps({
                "rounds": 1, "min_devices": options.devices, "local_epochs": options.local_epochs,
                "learning_rate": options.learning_rate,
                "batchnorm": options.batchnorm, "round_timeout_s": 3600,
                "strategy": options.strategy, "proximal_mu": options.proximal_mu,
                "server_learning_rate": options.server_learning_rate,
                "server_momentum": options.server_momentum,
                "initial_weights": str(global_weights), "record": str(out / "rounds.db"),
                "output_weights": str(out / f"global-{r}.npz")}), encoding="utf-8")  # YAML too
            if local.run(config, progress=progress) != 0:
                raise OdtdError(f"round {r}: flwr run failed; see {out / 'flower' / 'run' / 'flwr-run.log'}")
            global_weights = out / f"global-{r}.npz"
            if not global_weights.exists():  # `flwr run --stream` exits 0 when its run dies
                raise OdtdError(f"round {r}: Flower's run ended without aggregating the round; see "
                                f"{out / 'flower' / 'run' / 'flwr-run.log'} and "
                                f"{out / 'flower' / 'superlink.log'}")
            days.append(day)
        superlink_mb = read_proc_mb("VmHWM", Path(f"/proc/{local.superlink.pid}/status"))
    finally:
        local.stop()
        for process in daemons:
            process.terminate()
        for process in daemons:
            process.wait(timeout=60)
    result = _scored(out, devices, spec.name, base_weights, global_weights, days, progress)
    if every_day:
        from odtd.fleet.daily import score_days

        result["days_scored"] = score_days(out, options, progress, [d["tests"] for d in devices])
    with np.load(base_weights) as data:
        weights = {"arrays": len(data.files), "values": int(sum(data[k].size for k in data.files)),
                   "bytes": int(sum(data[k].nbytes for k in data.files))}
    result["scale"] = {"devices": options.devices, "rounds": sim.days,
                       # a train message to each device asked and its reply (no evaluate round)
                       "messages_per_round": 2 * options.devices, "weights_per_message": weights,
                       "superlink_peak_rss_mb": superlink_mb}
    return result


def _scored(out: Path, devices: List[Dict[str, Any]], model: str, base_weights: Path,
            global_weights: Path, days: List[Dict[str, Any]],
            progress: Callable[[str], None]) -> Dict[str, Any]:
    """Every arm's served model on each device's test images; the table."""
    progress("scoring every arm on each device's test images ...")
    rows = []
    for i, device in enumerate(devices):
        weights = {"base": base_weights, "alone": _served(device["alone"], model),
                   "adabn": device["adabn"].weights, "fleet": _served(device["fleet"], model),
                   "global": global_weights}
        scores = {arm: device["tests"].score(path, full=True).accuracy() for arm, path in weights.items()}
        rows.append({"device": i, "mix": device["mix"], "accuracy": scores})
    log = RoundLog(out / "rounds.db")
    rounds = log.every_round()  # one run a day: ``round`` is the day
    log.close()
    domain = "shifted" if "shifted" in rows[0]["accuracy"]["base"] else "clean"
    diffs = [row["accuracy"]["fleet"][domain] - row["accuracy"]["alone"][domain] for row in rows]
    mean = float(np.mean(diffs))
    se = float(np.std(diffs, ddof=1) / math.sqrt(len(diffs))) if len(diffs) > 1 else None
    table = _table(rows, rounds, domain, mean, se)
    return {"devices": rows, "rounds": rounds, "days": days, "domain": domain,
            "fleet_minus_alone": {"mean_points": round(100 * mean, 2),
                                  "se_points": None if se is None else round(100 * se, 2)},
            "table": table}


def _table(rows: List[Dict[str, Any]], rounds: List[Dict[str, Any]], domain: str, mean: float,
           se: Optional[float]) -> List[str]:
    arms = ("base", "alone", "adabn", "fleet", "global")
    domains = [domain] + (["clean"] if domain != "clean" else [])  # a shifted camera: both

    def cell(values: Dict[str, List[float]]) -> str:
        return "/".join(f"{100 * np.mean(values[d]):.1f}" for d in domains).center(13)

    lines = [f"accuracy (%) on each device's own test images, {' / '.join(domains)}"
             " (base: day 0; global: the fleet's last weights, unguarded):",
             f"{'device':>6} " + " ".join(f"{arm:^13}" for arm in arms)]
    for row in rows:
        lines.append(f"{row['device']:>6} " + " ".join(
            cell({d: [row["accuracy"][a][d]] for d in domains}) for a in arms))
    lines.append(f"{'mean':>6} " + " ".join(
        cell({d: [r["accuracy"][a][d] for r in rows] for d in domains}) for a in arms))
    lines.append(f"fleet - alone ({domain}, paired over devices): {100 * mean:+.2f} points"
                 + (f" (standard error {100 * se:.2f})" if se is not None else ""))
    def share(value: Optional[float]) -> str:
        return "-" if value is None else format(value, ".0%")

    for r in rounds:
        lines.append(f"round {r['round']}: {r['trained']}/{r['asked']} trained, "
                     f"{r['seconds']:.1f} s, joules {r['joules']}, outside the sessions "
                     f"{share(r['outside_share'])}, Flower's part {share(r['flower_share'])}")
    return lines
