"""``odtctl simulate``: days of the daily cycle, through exactly the code of real sessions.

Each simulated day writes its new images as files, ingests them stamped with that day (the
same ``Ingestor`` as ``odtctl ingest``), then runs a session with the same ``SessionRunner``
as the daemon. Only the source of the images is simulated. With ``shift``, the device's camera
differs from the server's (``odtd.sim.shifts``): the day's images, and so the samples held out
of them, and the validation set are shifted; the pre-training images never are.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from datetime import date, timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from odtd import atomic
from odtd.config import Config
from odtd.errors import ConfigError
from odtd.home.create import InitRequest, init_home
from odtd.home.ingest import Ingestor, discover
from odtd.home.paths import UNLABELLED_FOLDER, Home
from odtd.home.spec import ModelSpec
from odtd.home.versions import ModelRepo
from odtd.policy import load_policy
from odtd.report.status import energy_text, pct, sessions_table
from odtd.session.runner import SessionRunner
from odtd.sim import datasets
from odtd.sim.scenario import Scenario, mixed_sample, stream_draws
from odtd.sim.shifts import Shift, get_shift
from odtd.store.database import Store
from odtd.telemetry.meter import SessionEnergyMeter, running_sampler
from odtd.trainer.protocol.job import make_job
from odtd.trainer.protocol.launch import precision_said, run_job


@dataclass
class SimulationOptions:
    """What ``odtctl simulate`` runs (see its ``--help``)."""

    days: int = 7
    per_day: int = 64
    model: str = "tinycnn"
    dataset: str = "synthetic"
    pretrain_samples: int = 2000
    pretrain_epochs: int = 4
    pretrain_batch_size: int = 32
    pretrain_learning_rate: float = 0.05
    validation_samples: int = 500
    fresh: bool = False
    seed: int = 0
    policy: Optional[str] = None
    start_day: Optional[str] = None
    shift: Optional[str] = None
    priors: Optional[str] = None  # dirichlet:ALPHA: the device's class mix (odtd.sim.scenario)
    stream: Optional[str] = None  # runs:MEAN: its images in runs of one class
    unlabelled: int = 0  # more images a day without labels, from the same stream


class DataSource:
    """Server data (pre-training), a validation set and a pool of device images for the days.

    Raises:
        ConfigError: ``options.shift`` is not a camera shift (the message lists them).
    """

    def __init__(self, options: SimulationOptions) -> None:
        self.options = options
        self.shift: Optional[Shift] = get_shift(options.shift) if options.shift else None
        self.scenario = Scenario.parse(options.priors, options.stream, options.unlabelled)
        self.classes = list(datasets.CLASSES)
        synthetic = options.dataset == "synthetic"
        self.dataset = None if synthetic else datasets.open_dataset(Path(options.dataset))
        if self.dataset is not None:
            self.classes = list(self.dataset.classes)
        elif not self.scenario.even:
            raise ConfigError("--priors, --stream and --unlabelled draw a device's days from a "
                              "labelled data set: give --dataset (a <split>/<class>/ folder or the "
                              "CIFAR-10 archive)")

    def server(self, n: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
        """Pre-training data: the synthetic server domain, or the dataset's first train images.

        ``n``: how many (default ``pretrain_samples``); the first ``n`` of them either way.
        """
        n, seed = self.options.pretrain_samples if n is None else n, self.options.seed
        if self.dataset is None:
            return datasets.synthetic(n, "server", seed=seed)
        files = self.dataset.files("train")
        indices = datasets.take_per_class(
            np.array([label for _, label in files]), -(-n // len(self.classes)), seed=seed
        )[:n]
        return self.dataset.load_arrays("train", indices)

    def validation(self) -> tuple[np.ndarray, np.ndarray]:
        """The fixed validation set: device-domain images, or the dataset's test split (shifted).

        Drawn with the device's class mix under ``--priors``, as its days are.
        """
        n = self.options.validation_samples
        if self.dataset is None:
            x, y = datasets.synthetic(n, "device", seed=self.options.seed + 1)
        else:
            files = self.dataset.files("test")
            labels = np.array([label for _, label in files])
            if self.scenario.priors is not None:  # the device's own mix, as its days
                indices = mixed_sample(labels, n, self.scenario.mix(len(self.classes), self.options.seed),
                                       self.options.seed)
            else:
                indices = datasets.take_per_class(labels, -(-n // len(self.classes)),
                                                  seed=self.options.seed)[:n]
            x, y = self.dataset.load_arrays("test", indices)
        return (x if self.shift is None else self.shift(x, seed=[self.options.seed, 0])), y

    def write_day(self, day_index: int, offset: int, out_dir: Path) -> None:
        """Write day ``day_index``'s new images under ``out_dir/<class>/`` (shifted: as PNG).

        With ``--unlabelled``, the day's images without a label under ``out_dir/_unlabelled/``.
        """
        k = self.options.per_day
        day_number = offset + day_index
        if self.dataset is None:
            x, y = datasets.synthetic(k, "device", seed=self.options.seed + 1000 + day_number)
        else:
            indices, unlabelled = self._day_indices(day_number)
            if len(unlabelled):
                ux = self.dataset.load_arrays("train", unlabelled)[0]
                ux = ux if self.shift is None else self.shift(ux, seed=[self.options.seed, 5000 + day_number])
                datasets.write_image_folder(ux, np.zeros(len(ux), np.int64), [UNLABELLED_FOLDER],
                                            out_dir, fmt="png", start_index=day_number * len(ux))
            if self.shift is None:  # the original files, as a camera would write them
                files = self.dataset.files("train")
                self.dataset.extract("train", [files[i][0] for i in indices], out_dir)
                return
            x, y = self.dataset.load_arrays("train", indices)
        if self.shift is not None:
            x = self.shift(x, seed=[self.options.seed, 1 + day_number])
        datasets.write_image_folder(x, y, self.classes, out_dir, fmt="png", start_index=day_number * k)

    def _day_indices(self, day_number: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices into the dataset's train split of day ``day_number``'s images: with labels, without."""
        k = self.options.per_day
        files = self.dataset.files("train")
        labels = np.array([label for _, label in files])
        used = set(datasets.take_per_class(
            labels, -(-self.options.pretrain_samples // len(self.classes)), seed=self.options.seed
        )[: self.options.pretrain_samples])
        try:
            if not self.scenario.even:  # the device's mix and runs, the stream going on day by day
                return stream_draws(labels, day_number + 1, k, self.scenario, self.options.seed,
                                    exclude=sorted(used))[day_number]
            draws = datasets.daily_draws(labels, day_number + 1, k, seed=self.options.seed,
                                         exclude=sorted(used))
        except ValueError as error:  # the home's earlier days count: day_number is since init
            raise ConfigError(
                f"--dataset {self.options.dataset}: {error} (the pre-training's "
                f"{self.options.pretrain_samples}, --pretrain-samples, are never drawn); "
                "fewer --days or --per-day, or a larger dataset") from None
        return draws[day_number], np.zeros(0, np.int64)


def simulate(home: Home, options: SimulationOptions,
             progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """Run the simulation; create (and pre-train) the home first when needed.

    Returns:
        ``{"sessions": [...], "table": [text lines], "pretrain": {...} or None, "shift": name
        or None}``.

    Raises:
        ConfigError: a bad count, an unknown shift, or a shift other than the one the home was
            created with (its validation set is of that camera).
    """
    if options.days < 1 or options.per_day < 1:
        raise ConfigError("--days and --per-day must be at least 1")
    source = DataSource(options)
    pretrain = None
    created = options.fresh or not home.is_initialised()
    if created:
        progress(f"creating {home.root} with {options.model}"
                 + (f", the device's camera shifted ({options.shift})" if options.shift else "")
                 + " ...")
        init_home(home, InitRequest(options.model, source.classes, force=options.fresh,
                                    seed=options.seed, validation_arrays=source.validation()))
        if options.policy:
            install_policy(home, Path(options.policy))
        if options.pretrain_samples > 0:
            pretrain = pretrain_base(home, source, options, progress)
    store = home.open_store()
    try:
        classes = store.meta("classes")
        if sorted(classes) != sorted(source.classes):
            raise ConfigError(
                f"--dataset {options.dataset}: its classes ({', '.join(source.classes)}) are not "
                f"the ones {home.root} serves ({', '.join(classes)})")
        if created:
            store.set_meta(simulated_shift=options.shift)
        elif store.meta("simulated_shift") != options.shift:
            was = store.meta("simulated_shift")
            raise ConfigError(
                f"--shift {options.shift or '(none)'}: {home.root} was created "
                + (f"with --shift {was}" if was else "without a shift")
                + ", and its validation set is of that camera; pass the same --shift, or --fresh "
                f"to re-create the home with --model {options.model} (it deletes the model and "
                "the state the home holds)")
        config = home.load_config()
        with running_sampler(config.telemetry) as sampler:
            sessions = _run_days(home, store, config, source, options, sampler, progress)
    finally:
        store.close()
    return {"sessions": sessions, "pretrain": pretrain, "shift": options.shift,
            "table": sessions_table(list(reversed(sessions)))}


def _run_days(home: Home, store: Store, config: Config, source: DataSource,
              options: SimulationOptions, sampler: Any,
              progress: Callable[[str], None]) -> list[dict[str, Any]]:
    runner = SessionRunner(home, store, config, load_policy(home.policy_path(config)),
                           energy_meter=SessionEnergyMeter(sampler))
    ingestor = Ingestor.for_home(home, store)
    offset = len(store.sessions(done_only=True))
    start = date.fromisoformat(options.start_day) if options.start_day else date.today()
    sessions = []
    for index in range(options.days):
        day = (start + timedelta(days=index)).isoformat()
        with tempfile.TemporaryDirectory(dir=home.runs) as tmp:
            source.write_day(index, offset, Path(tmp))
            report = ingestor.ingest(discover(Path(tmp), None), day=day)
        progress(f"day {index + 1}/{options.days} ({day}): ingested {report.accepted} "
                 f"({report.holdout} held out); training ...")
        session = runner.run(trigger="simulate", day=day).to_dict()
        sessions.append(session)
        progress(f"day {index + 1}/{options.days}: {session['outcome']}, accuracy "
                 f"{pct(session['accuracy_before'])} -> {pct(session['accuracy_after'])}, "
                 f"{session['duration_s']} s, energy {energy_text(session)}")
    return sessions


def install_policy(home: Home, policy: Path) -> None:
    """Validate a policy file and make it the home's active policy."""
    load_policy(policy, missing_ok=False)
    config = home.load_config()
    atomic.write_text(home.policy_path(config), policy.read_text(encoding="utf-8"))


def pretrain_base(home: Home, source: DataSource, options: SimulationOptions,
                  progress: Callable[[str], None]) -> dict[str, Any]:
    """Train the base model on server data (standing in for the server) and make it current.

    The rate anneals to 0 over the epochs (cosine) and BatchNorm's moving statistics are
    recalibrated under the final weights, as a finished server model's would be: stopped at a
    constant rate, a short pre-training ends wherever the last steps threw it, and any rounding
    difference sends it elsewhere (the demo's base scored 27-34% that way, 44-47% since).
    """
    x, y = source.server()
    store = Store(home.db_path)
    try:
        model = store.meta("model")
        repo = ModelRepo(home.models, model)
        parent = repo.current()
        config: Config = home.load_config()
        precision = load_policy(home.policy_path(config)).training.precision
        with tempfile.TemporaryDirectory(dir=home.runs) as tmp:
            np.savez(Path(tmp) / "server.npz", x=x, y=y)
            spec = ModelSpec.from_store(store)
            job = make_job(
                "train", model, spec.classes, spec.input_shape, **spec.job_keys(home),
                weights_in=str(repo.weights_path(parent)),
                weights_out=str(Path(tmp) / "pretrained.npz"), train_data=str(Path(tmp) / "server.npz"),
                validation_data=str(home.validation_file()), batch_size=options.pretrain_batch_size,
                epochs=options.pretrain_epochs, optimizer="sgd",
                learning_rate=options.pretrain_learning_rate, momentum=0.9, augment=True,
                lr_schedule="cosine", recalibrate_bn=True,
                seed=options.seed, precision=precision,
                precision_probe=str(home.precision_probe))
            total_steps = options.pretrain_epochs * -(-len(y) // options.pretrain_batch_size)

            def show(message: dict[str, Any]) -> None:
                if said := precision_said(message):
                    progress(f"pre-training: {said}")
                elif message.get("event") == "step" and (message["index"] + 1) % 25 == 0:
                    progress(f"pre-training: step {message['index'] + 1}/{total_steps}, "
                             f"loss {message['loss']:.3f}")

            epochs = options.pretrain_epochs
            progress(f"pre-training {model} on {len(y)} server images, {epochs} "
                     f"epoch{'' if epochs == 1 else 's'} (stands in for the server) ...")
            result, _, _ = run_job(config.trainer.command(), job, Path(tmp), on_message=show)
            version, manifest = repo.add_version(
                Path(tmp) / "pretrained.npz", classes=store.meta("classes"),
                input_shape=store.meta("input_shape"), param_count=result.get("param_count"),
                parent=parent, metrics={"accuracy": result.get("accuracy_after")},
                weight_names=result.get("weight_names"), move=True,
            )
        with store.transaction():
            store.add_model_version({
                "model": model, "version": version, "parent": parent, "session_id": None,
                "sha256": manifest["sha256"], "param_count": manifest["param_count"],
                "accuracy": result.get("accuracy_after"),
            })
            store.log_event("pretrained", f"{model} v{version} pre-trained on {len(y)} server images")
            repo.set_current(version)
    finally:
        store.close()
    progress(f"pre-trained {model} v{version}: validation accuracy {pct(result.get('accuracy_after'))}")
    return {"version": version, "samples": int(len(y)), "accuracy": result.get("accuracy_after"),
            "duration_s": result.get("duration_s")}
