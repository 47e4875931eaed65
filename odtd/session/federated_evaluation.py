"""A Flower evaluate round on a device: the round's global model scored on the device's own set.

The SuperNode's ClientApp (``@app.evaluate``, ``odtd.fleet.client``) asks the daemon over the
control socket (op ``federated-evaluate``); the daemon runs this in a task process, under the
session lock, so it never runs beside a session. The round's weights are checked as a
federated session checks them (``write_start_weights``: same arrays, shapes, dtypes, finite;
``fedbn`` keeps the device's BatchNorm parameters), then the worker's ``evaluate`` job scores
them on the device's evaluation set (``evalset``: validation, hold-out, reference). Nothing is
trained or served and no session row is written: an evaluation is a measurement, not a session.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Dict

import numpy as np

from odtd.config import Config
from odtd.errors import OdtdError
from odtd.home.paths import Home
from odtd.home.spec import ModelSpec
from odtd.home.versions import ModelRepo
from odtd.policy import load_policy
from odtd.session.evalset import write_evaluation_set
from odtd.session.federated import EXCHANGE_DIR, FederatedRound, round_start
from odtd.session.lock import SessionLock
from odtd.session.result import GROUP_HOLDOUT, GROUP_REFERENCE, GROUP_VALIDATION
from odtd.store.database import Store
from odtd.trainer.protocol.job import make_job
from odtd.trainer.protocol.launch import TrainerFailed, run_job


def evaluate_round(home: Home, store: Store, config: Config, args: Dict[str, Any]) -> Dict[str, Any]:
    """Score a round's global weights on the device's evaluation set.

    Args:
        home: The device's home.
        store: Its open store.
        config: Its ``odtd.yaml`` (the worker's command).
        args: ``FederatedRound``'s fields (``weights_out`` is not written).

    Returns:
        ``num-examples`` (the held-out samples, else the validation set's), ``accuracy`` (on
        them), ``validation-accuracy``, ``holdout-accuracy``, ``reference-accuracy`` (NaN where
        the home has no such set) and ``device-seconds``.

    Raises:
        OdtdError: the weights do not fit the served model, the home has nothing to score on,
            a session is running (``SessionBusy``), or the worker failed (one line each).
    """
    started = time.monotonic()
    federated = FederatedRound.from_args(args, home.run / EXCHANGE_DIR)
    spec = ModelSpec.from_store(store)
    repo = ModelRepo(home.models, spec.name)
    with SessionLock(home.session_lock), tempfile.TemporaryDirectory(dir=home.runs) as tmp:
        job_dir = Path(tmp)
        start = round_start(federated, repo, repo.current(), job_dir).path
        _, evaluation = write_evaluation_set(home, store, spec.classes, job_dir)
        if evaluation is None:
            raise OdtdError("no validation set and no held-out samples to score the round's "
                            "model on: give the home --validation or ingest more images")
        with np.load(evaluation, allow_pickle=False) as data:
            counts = np.bincount(data["group"], minlength=GROUP_REFERENCE + 1)
        # The policy's batches, as its sessions evaluate: the device's memory cap holds.
        policy = load_policy(home.policy_path(config))
        job = make_job("evaluate", spec.name, spec.classes, spec.input_shape,
                       weights_in=str(start), validation_data=str(evaluation),
                       batch_size=policy.batch.size, eval_batch_size=policy.training.eval_batch_size,
                       **spec.job_keys(home))
        try:
            result, _, _ = run_job(config.trainer.command(), job, job_dir / "job")
        except TrainerFailed as exc:
            raise OdtdError(f"the evaluation's worker failed: {exc}") from None
    by_group = result.get("by_group_after") or {}

    def accuracy(group: int) -> float:
        value = by_group.get(str(group))
        return float("nan") if value is None else float(value)

    # The device's own held-out images where it has them: its mix, its camera.
    primary = GROUP_HOLDOUT if counts[GROUP_HOLDOUT] else GROUP_VALIDATION
    return {"num-examples": int(counts[primary]), "accuracy": accuracy(primary),
            "validation-accuracy": accuracy(GROUP_VALIDATION),
            "holdout-accuracy": accuracy(GROUP_HOLDOUT),
            "reference-accuracy": accuracy(GROUP_REFERENCE),
            "device-seconds": time.monotonic() - started}
