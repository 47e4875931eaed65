"""A check of the policy before the first night: does the model train at all under it?

``odtctl policy check`` (and ``odtctl init --model-file``, which runs it) trains a copy of the
served model for a few steps of the policy's recipe, on the images the home already has (the
replay seed, else the validation set), in a worker like a session's, and writes nothing but
what it learned about the learning rate: no model version, no session. It reports a loss that
is not finite at every rate the policy lets a session try, or one that rises, as one line with
the fix. A rate that trained only after a retry is remembered for the model
(``learning_rate.remember_rate``), so the first night starts there.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from odtd.config import Config
from odtd.home.ingest import load_sample_arrays
from odtd.home.paths import Home
from odtd.home.replay_buffer import choose_replay
from odtd.home.spec import ModelSpec
from odtd.home.versions import ModelRepo
from odtd.policy import Policy
from odtd.session.learning_rate import remember_rate, starting_rate
from odtd.store.database import Store
from odtd.trainer.protocol.job import make_job
from odtd.trainer.protocol.launch import WorkerRun, diverged, write_job

DAY_IMAGES = 64  # a day's new images in the reference scenario: what a session trains on
MIN_STEPS = 16  # enough steps to tell a falling loss from a rising one
FIRST_STEPS = 2  # their mean loss is the served model's on the images (barely trained yet)
RISE = 1.2  # the last third's mean loss this many times the first steps': rising...
# ...and above a guess's (the cross-entropy of equal odds on every class, ln K): a model that
# already fits its images leaves its minimum under a session's first steps, and its loss on
# them rises a little from near zero while it learns the camera (docs/own-model.md, the zoo).


@dataclass
class PolicyCheck:
    """What ``check_policy`` found.

    Attributes:
        verdict: ``ok``, ``warning`` (the loss rose, or trained only at a lower rate),
            ``diverged`` (at every rate tried) or ``skipped`` (no images, or the worker failed).
        message: One line for a person, with the fix where there is one.
        images: Images trained on; ``source``: ``replay seed`` or ``validation set``.
        steps: Steps of the last attempt.
        learning_rate: The peak rate of the last attempt.
        lr_attempts: The rates that diverged (``{learning_rate, diverged_at_step}``).
        loss_first: Mean loss of the last attempt's first ``FIRST_STEPS`` steps: the model
            as served, before the steps moved it much.
        loss_last: Mean loss over its last third.
        seconds: The worker's wall time.
    """

    verdict: str
    message: str
    images: int = 0
    source: Optional[str] = None
    steps: int = 0
    learning_rate: Optional[float] = None
    lr_attempts: Optional[list[dict[str, Any]]] = None
    loss_first: Optional[float] = None
    loss_last: Optional[float] = None
    seconds: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` object."""
        return asdict(self)


def check_images(home: Home, store: Store, policy: Policy, classes: list[str]
                 ) -> tuple[Optional[tuple[np.ndarray, np.ndarray]], Optional[str]]:
    """A session's worth of images to check with: the replay seed's, else the validation set's.

    As many as a session of ``DAY_IMAGES`` new images trains on (its rehearsal included).
    """
    replay = policy.replay
    wanted = DAY_IMAGES + min(int(round(replay.ratio * DAY_IMAGES)), replay.max_samples)
    draw = replay.model_copy(update={"ratio": 1.0, "max_samples": wanted, "device_share": 0.0})
    rows = choose_replay(store, draw, wanted, seed=0)
    if rows:
        return load_sample_arrays(home, rows, classes), "replay seed"
    if home.validation_file().exists():
        with np.load(home.validation_file(), allow_pickle=False) as data:
            order = np.random.RandomState(0).permutation(len(data["y"]))[:wanted]
            return (data["x"][order], data["y"][order]), "validation set"
    return None, None


def check_policy(home: Home, store: Store, config: Config, policy: Policy,
                 progress: Optional[Callable[[str], None]] = None, remember: bool = True
                 ) -> PolicyCheck:
    """Train a few steps of ``policy`` on the home's images; say whether the loss falls.

    With ``remember`` (the home's own policy), a lower rate that trained after a divergence is
    remembered for the model; a policy file only being tried leaves the home as it was.
    """
    say = progress or (lambda message: None)
    spec = ModelSpec.from_store(store)
    images, source = check_images(home, store, policy, spec.classes)
    if images is None:
        return PolicyCheck("skipped", "policy not checked: the home has no images to train on "
                           "(init with --replay or --validation)")
    training = policy.training
    batch_size = min(policy.batch.size, len(images[1]))
    per_epoch = math.ceil(len(images[1]) / batch_size)
    epochs = max(training.epochs, math.ceil(MIN_STEPS / per_epoch))
    rate = starting_rate(store, spec.name, training)
    repo = ModelRepo(home.models, spec.name)
    home.runs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="policy-check-", dir=home.runs) as staging:
        job_dir = Path(staging)
        data = job_dir / "train.npz"
        np.savez(data, x=images[0], y=images[1])
        job = make_job(
            "train", spec.name, spec.classes, spec.input_shape,
            weights_in=str(repo.weights_path(repo.current())), train_data=str(data),
            batch_size=batch_size, epochs=epochs, optimizer=training.optimizer,
            learning_rate=rate.rate, lr_schedule=training.lr_schedule,
            momentum=training.momentum, clip_norm=training.clip_norm,
            diverged_retries=training.diverged_retries,
            diverged_lr_factor=training.diverged_lr_factor, augment=training.augment,
            freeze_bn=training.freeze_bn, trainable=training.trainable, seed=training.seed,
            parent_pid=os.getpid(), precision=training.precision,
            precision_probe=str(home.precision_probe), **spec.job_keys(home))
        say(f"policy check: {epochs * per_epoch} steps of batch {batch_size} at learning rate "
            f"{rate.rate:g} on {len(images[1])} images of the {source} ...")
        worker = WorkerRun(config.trainer.command(), write_job(job, job_dir),
                           job_dir / "worker.stderr")
        end = worker.follow(timeout_s=config.trainer.timeout_s, grace_s=5.0)
    found = PolicyCheck("ok", "", images=len(images[1]), source=source,
                        seconds=round(end.duration_s, 1))
    if end.failure is not None or end.result is None:
        found.verdict, found.message = "skipped", f"policy not checked: {end.failure}"
        return found
    result = end.result
    found.learning_rate, found.lr_attempts = result.get("learning_rate"), result.get("lr_attempts")
    steps = _last_attempt(end.steps)
    found.steps = len(steps)
    reason = diverged(result)
    if reason is not None:
        found.verdict, found.message = "diverged", f"policy check: {reason}"
        return found
    found.loss_first, found.loss_last, rising = loss_trend(
        [step["loss"] for step in steps if step.get("loss") is not None], len(spec.classes))
    shown = f"loss {found.loss_first:.3g} -> {found.loss_last:.3g} over {found.steps} steps " \
        f"at learning rate {found.learning_rate:g}" if found.loss_first is not None else "no steps"
    if found.lr_attempts:
        if remember:
            remember_rate(store, spec.name, training, result, "policy check")
        found.verdict = "warning"
        found.message = (f"policy check: training diverged at learning rate "
                         f"{found.lr_attempts[0]['learning_rate']:g} and trained at "
                         f"{found.learning_rate:g} ({shown}); " + (
                             f"sessions start at {found.learning_rate:g}" if remember else
                             f"sessions under this policy would retry at {found.learning_rate:g}")
                         + " (set training.learning_rate to it to make it the policy's)")
    elif rising:
        found.verdict = "warning"
        found.message = (f"policy check: the loss rose above a guess's ({shown}; ln "
                         f"{len(spec.classes)} = {math.log(len(spec.classes)):.3g}); lower "
                         "training.learning_rate "
                         f"(to {found.learning_rate / 10:g}, say) or set training.clip_norm")
    else:
        found.message = f"policy check: ok, {shown}"
    return found


def loss_trend(losses: list[float], classes: int) -> tuple[Optional[float], Optional[float], bool]:
    """(mean of the first ``FIRST_STEPS`` losses, mean of the last third, whether it rose).

    Rising: the last third's mean more than ``RISE`` times the first steps' and more than a
    guess's among ``classes`` (ln of it). None, None, False without losses.
    """
    if not losses:
        return None, None, False
    first = float(np.mean(losses[:FIRST_STEPS]))
    last = float(np.mean(losses[-max(1, len(losses) // 3):]))
    return round(first, 4), round(last, 4), last > max(first * RISE, math.log(classes))


def _last_attempt(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step events of the worker's last attempt (each retry after a divergence is one)."""
    last = max((step.get("attempt", 0) for step in steps), default=0)
    return [step for step in steps if step.get("attempt", 0) == last]
