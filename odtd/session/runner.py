"""One training session: samples in, a worker run, guarded promotion, one sessions row out.

The runner is shared by ``odtctl train-now --foreground``, ``odtctl simulate`` and the daemon.
A session never leaves a broken model behind: the worker writes a candidate; only a candidate
that passes acceptance becomes a new version and ``current`` (``promotion``); a crash, kill or
timeout of the worker, or an error while accepting, leaves the served model and the pending
samples as they were.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from datetime import date
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from odtd.config import Config
from odtd.errors import OdtdError, as_odtd_error, failure_reason
from odtd.home.disk import room_for_session
from odtd.home.ingest import load_sample_arrays
from odtd.home.paths import Home
from odtd.home.replay_buffer import choose_replay
from odtd.home.spec import ModelSpec
from odtd.home.versions import ModelRepo, offset_job_keys
from odtd.policy import Policy
from odtd.session.admission import SKIP, admit_session
from odtd.session.evalset import write_evaluation_set
from odtd.session.federated import TRAINED_WEIGHTS, FederatedRound, hand_back, round_start, trains_from_round
from odtd.session.gates import (
    FORCE_CLOSED_FILE,
    GateMonitor,
    StopRequest,
    check_gates,
    samples_wanted,
)
from odtd.session.learning_rate import remember_rate, starting_rate
from odtd.session.lock import SessionLock, recover_stale_sessions
from odtd.session.oom import oom_retry_batch, record_oom
from odtd.session.promotion import CANDIDATE_EVAL_CACHE, Promotion
from odtd.session.result import GROUP_HOLDOUT, GROUP_REFERENCE, GROUP_VALIDATION, read_result, throughput_sps
from odtd.store.database import Store
from odtd.store.records import SessionRecord
from odtd.store.samples import DEVICE_READ, UNLABELLED_READ
from odtd.trainer.protocol.job import make_job
from odtd.trainer.protocol.launch import WARMUP_STEPS, WorkerEnd, WorkerRun, precision_said, write_job

logger = logging.getLogger(__name__)

GROUP_NAMES = {str(GROUP_VALIDATION): "validation", str(GROUP_HOLDOUT): "the device hold-out",
               str(GROUP_REFERENCE): "the reference"}


def _accuracies(evaluation: dict[str, Any]) -> str:
    """'71.2% on validation, 64.0% on the device hold-out' (each set apart), else '70.3%'."""
    by_group = evaluation.get("by_group") or {}
    named = [f"{by_group[group] * 100:.1f}% on {name}" for group, name in GROUP_NAMES.items()
             if by_group.get(group) is not None]
    return ", ".join(named) if named else f"{evaluation.get('accuracy', 0) * 100:.1f}%"


_PROGRESS_ROW_S = 2.0


class SessionRunner:
    """Runs sessions for one home.

    Args:
        home: the state directory.
        store: its open database.
        config: the daemon configuration (trainer command, timeouts).
        policy: the active policy.
        energy_meter: optional telemetry hook with ``begin() -> token`` and
            ``end(token, steps) -> dict`` (session energy fields); None records no energy.
        heartbeat: called every poll while a worker runs (the systemd watchdog ping).
        progress: called with one-line progress messages (the CLI prints them to stderr).
        root: filesystem root the gates read (batteries, thermal zones, load).
    """

    def __init__(
        self,
        home: Home,
        store: Store,
        config: Config,
        policy: Policy,
        energy_meter: Any = None,
        heartbeat: Optional[Callable[[], None]] = None,
        progress: Optional[Callable[[str], None]] = None,
        root: Path = Path("/"),
    ) -> None:
        self.home = home
        self.store = store
        self.config = config
        self.policy = policy
        self.energy_meter = energy_meter
        self.heartbeat = heartbeat
        self.progress = progress or (lambda message: None)
        self.spec = ModelSpec.from_store(store)
        self.model = self.spec.name
        self.classes = self.spec.classes
        self.input_shape = self.spec.input_shape
        self.repo = ModelRepo(home.models, self.model)
        self.root = root
        self.force_file = home.run / FORCE_CLOSED_FILE

    def run(self, trigger: str = "cli", day: Optional[str] = None,
            stop: Optional[StopRequest] = None, force: bool = False,
            federated: Optional[FederatedRound] = None) -> SessionRecord:
        """Run one session and return its record.

        Args:
            trigger: what started it (cli, schedule, socket, simulate).
            day: YYYY-MM-DD the session belongs to (default: today).
            stop: request it to stop the worker at its next step boundary (outcome interrupted).
            force: bypass the policy's gates (never the memory budget or the OOM rules).
            federated: a Flower round's (``odtd.session.federated``): from its weights, the
                trained ones handed back; the guard judges against the served model as ever.

        Raises:
            SessionBusy: another session holds the lock.
        """
        with SessionLock(self.home.session_lock):
            recover_stale_sessions(self.store, self.home)
            return self._run_locked(trigger, day or date.today().isoformat(),
                                    stop or StopRequest(), force, federated)

    def _run_locked(self, trigger: str, day: str, stop: StopRequest, force: bool,
                    federated: Optional[FederatedRound] = None) -> SessionRecord:
        policy = self.policy
        current = self.repo.current()
        self.repo.verify(current)
        pending = self.store.samples("pending", limit=policy.training.max_samples_per_session)
        record = SessionRecord(day=day, trigger=trigger, model_version_before=current,
                               model_version_after=current, batch_size=policy.batch.size,
                               epochs=policy.training.epochs, samples_new=0, samples_replay=0)
        record.details.forced = force
        record.details.federated = federated.to_details() if federated else None
        self.store.start_session(record)
        job_dir = self.home.runs / f"session-{record.id}"
        if federated:  # the round's weights checked and written before anything else
            try:
                start = round_start(federated, self.repo, current, job_dir)
            except OdtdError as exc:
                return self._finish(record, "failed", str(exc))
            record.details.federated["already_served"] = start.already_served
        if not pending:
            return self._finish(record, "skipped", "no pending samples")
        # A fleet's round starts from the fleet's new model, not from the start a refusal was
        # of: the backoff after one does not hold it back (the policy's minimum still does).
        last = None if federated else self.store.last_judged_session()
        wanted = samples_wanted(policy.schedule, last, policy.training.max_samples_per_session)
        if len(pending) < wanted and not force:
            why = f" (after refused session {last.id})" if last and last.outcome == "rolled_back" else ""
            return self._finish(record, "skipped", f"waiting for {wanted} new samples, "
                                f"{len(pending)} pending{why}")
        closed = [] if force else [g for g in check_gates(policy.gates, self.root, None, self.force_file)
                                   if not g.passed]
        if closed:
            return self._finish(record, "skipped", f"gate {closed[0].name} closed: {closed[0].reason}")
        replay_rows = choose_replay(self.store, policy.replay, len(pending), seed=record.id)
        record.samples_new, record.samples_replay = len(pending), len(replay_rows)
        admission = admit_session(self.store, policy, samples=len(pending) + len(replay_rows))
        record.batch_size, record.epochs = admission.batch_size, admission.epochs
        record.details.admission = admission.to_dict()
        record.details.learning_rate = starting_rate(self.store, self.model, policy.training).rate
        # Resuming trains on from the last refused candidate, always judged against current.
        record.details.resumed = policy.training.resume_within is not None and \
            self.repo.resume_path.exists() and federated is None
        if federated:  # the server's local epochs and rate; admission's batch and memory plan
            record.epochs = federated.epochs or record.epochs
            record.details.learning_rate = federated.learning_rate or record.details.learning_rate
        if admission.decision == SKIP:
            return self._finish(record, "skipped", admission.reason)
        if refusal := room_for_session(self.home, self.store, self.config.storage, policy,
                                       pending + replay_rows, self.repo.weights_path(current)):
            return self._finish(record, "skipped", refusal)  # the disk: no night spent failing
        try:
            result = self._train_with_retries(record, job_dir, current, pending + replay_rows, stop)
        except BaseException as exc:
            # Record before propagating: a session row must never stay `running` by our hand.
            self._finish(record, "failed", failure_reason(exc, database=self.home.db_path))
            raise
        if result is None:  # failed or interrupted; the record says which and why
            return self._finish(record, record.outcome, record.reason)
        if federated:  # the trained weights go to the server whether or not this device serves them
            record.details.federated["handed_back"] = hand_back(job_dir, federated)
        try:
            Promotion(self.home, self.store, self.repo, self.policy, self.progress).conclude(
                record, pending, job_dir, result)
        except BaseException as exc:
            # Promotion is all or nothing: the served model, the versions, the samples and the
            # replay buffer are as they were; the session is failed, with why.
            if as_odtd_error(exc, self.home.db_path) is None:  # a bug: its traceback
                logger.exception("session %d: accepting the candidate failed", record.id)
            record.details.kept_for_resume = False
            record.details.replay_buffer = None
            record.model_version_after = current
            reason = failure_reason(exc, "accepting the candidate", self.home.db_path)
            self._finish(record, "failed", f"{reason}; the served model, its versions and the "
                         "samples are unchanged")
            if not isinstance(exc, Exception):
                raise
            return record
        return self._finished(record)

    def _train_with_retries(self, record: SessionRecord, job_dir: Path, current: int,
                            rows: list[dict[str, Any]], stop: StopRequest) -> Optional[dict[str, Any]]:
        """Run the worker, halving the batch after an out-of-memory as ``batch.on_oom`` says.

        Returns:
            The worker's result event, or None with the record's outcome set to ``failed`` or
            ``interrupted`` and its reason.
        """
        job_path = self._write_job(job_dir, current, rows, record)
        while True:
            self.progress(f"session {record.id}: {record.samples_new} new + {record.samples_replay} "
                          f"replay samples, batch {record.batch_size}, {record.epochs} epochs; "
                          "worker starting")
            self.store.save_session(record)
            with self._gate_monitor(stop, record.details.forced):
                end = self._follow_worker(record, job_dir, job_path, stop)
            if end.stop_reason and (end.result is None or end.result.get("status") == "interrupted"):
                record.outcome, record.reason = "interrupted", end.stop_reason
                return None
            if end.failure is None:
                if remember_rate(self.store, self.model, self.policy.training, end.result,
                                 f"session {record.id}"):
                    self.progress(f"session {record.id}: trained at learning rate "
                                  f"{end.result['learning_rate']:g}; later sessions start there")
                return end.result
            record.details.attempts.append({"batch_size": record.batch_size, "reason": end.failure,
                                            "oom": end.oom})
            retry = self._after_oom(end.oom, record.batch_size, stop)
            if retry is None:
                record.outcome, record.reason = "failed", end.failure
                return None
            self.progress(f"session {record.id}: out of memory at batch {record.batch_size}; "
                          f"retrying at batch {retry} (on_oom: halve)")
            record.batch_size = retry
            job_path = self._write_job(job_dir, current, rows, record)

    def _gate_monitor(self, stop: StopRequest, force: bool) -> Any:
        if force:
            return nullcontext()
        return GateMonitor(self.policy.gates, stop, root=self.root, force_file=self.force_file)

    def _after_oom(self, oom: bool, batch_size: int, stop: StopRequest) -> Optional[int]:
        """Apply ``batch.on_oom`` to a failed attempt; return the batch to retry at, or None."""
        if not oom or stop.is_set():
            return None
        record_oom(self.store, self.model, batch_size)
        return oom_retry_batch(self.policy.batch, batch_size)

    def _write_job(self, job_dir: Path, current: int, rows: list[dict[str, Any]],
                   record: SessionRecord) -> Path:
        job_dir.mkdir(parents=True, exist_ok=True)
        train = job_dir / "train.npz"
        if not train.exists():
            x, y = load_sample_arrays(self.home, rows, self.classes)
            np.savez(train, x=x, y=y, **self._device_images(rows, record.samples_new))
        record.details.evaluation_set, validation = write_evaluation_set(
            self.home, self.store, self.classes, job_dir)
        training = self.policy.training
        plan = record.details.admission or {}  # the plan admission chose for the batch
        served_path = str(self.repo.weights_path(current))
        resume = record.details.resumed
        from_fleet = trains_from_round(record.details.federated)  # else as a local session
        # A resumed or federated session trains from other weights; "before" is the served model.
        start = str(self.repo.resume_path) if resume else \
            str(job_dir / "global.npz") if from_fleet else served_path
        job = make_job(
            "train", self.model, self.classes, self.input_shape,
            weights_in=start, served_weights=served_path if start != served_path else None,
            weights_out=str(job_dir / "candidate.npz"), train_data=str(train),
            trained_out=str(job_dir / TRAINED_WEIGHTS) if record.details.federated else None,
            validation_data=str(validation) if validation else None,
            batch_size=record.batch_size, epochs=record.epochs, optimizer=training.optimizer,
            learning_rate=record.details.learning_rate or training.learning_rate,
            lr_schedule=training.lr_schedule, momentum=training.momentum,
            clip_norm=training.clip_norm, diverged_retries=training.diverged_retries,
            diverged_lr_factor=training.diverged_lr_factor, augment=training.augment,
            freeze_bn=training.freeze_bn,
            recalibrate_bn=training.recalibrate_bn, bn_device_share=training.bn_device_share,
            distill=training.distill,
            trained_share=training.round_trained_share if from_fleet
            and training.round_trained_share is not None else training.trained_share,
            prior_correction=training.prior_correction, pseudo_labels=training.pseudo_labels,
            bn_class_balanced=training.bn_class_balanced, balanced_loss=training.balanced_loss,
            **offset_job_keys(self.repo.manifest(current)),
            average_with=("start+served" if training.federated_mix else "start")
            if from_fleet else "served",
            proximal_mu=float((record.details.federated or {}).get("proximal_mu") or 0.0),
            reference_tolerance=None if self.policy.acceptance.reference_tolerance is None
            else self.policy.acceptance.reference_tolerance / 100.0,
            reference_origin=self.store.reference_origin(),
            acceptance_tolerance=self.policy.acceptance.tolerance / 100.0,
            confidence_z=self.policy.acceptance.confidence_z,
            round_confidence_z=self.policy.acceptance.round_confidence_z if from_fleet else None,
            seed=training.seed, parent_pid=os.getpid(),
            precision=plan.get("precision", training.precision),
            precision_probe=str(self.home.precision_probe),
            recompute=float(plan.get("recompute") or 0), micro_batch_size=plan.get("micro_batch_size"),
            gpu_memory_limit_mb=training.gpu_memory_limit_mb,
            eval_batch_size=training.eval_batch_size, eval_cache=str(self.repo.eval_cache_path),
            # The candidate's results, adopted as the eval cache if it is promoted.
            eval_cache_out=str(job_dir / CANDIDATE_EVAL_CACHE), trainable=training.trainable,
            origin_eval_cache=str(self.repo.origin_eval_cache_path),
            **self.spec.job_keys(self.home))
        return write_job(job, job_dir)

    def _device_images(self, rows: list[dict[str, Any]], new_count: int) -> dict[str, np.ndarray]:
        """The train file's ``device`` mask, ``device_x`` and ``unlabelled_x``, as the policy needs.

        The device's images are the day's (the first ``new_count`` rows), rehearsed ones a
        session trained on before (not the replay seed's) and, in ``device_x``, earlier days'
        images not drawn this time, the newest first, up to ``DEVICE_READ`` in all
        (``bn_device_share``, ``distill``, ``prior_correction``); ``unlabelled_x``, the newest
        images without a label (``prior_correction``).
        """
        training = self.policy.training
        if not training.reads_device_images:
            return {}
        mask = np.array([i < new_count or bool(row.get("session_id")) for i, row in enumerate(rows)],
                        dtype=bool)
        drawn = {row["sha256"] for row in rows}
        room = max(0, DEVICE_READ - int(mask.sum()))
        earlier = [row for row in self.store.device_samples(room + len(drawn))
                   if row["sha256"] not in drawn][:room]
        if earlier:
            extra, extra_y = load_sample_arrays(self.home, earlier, self.classes)
        else:
            extra = np.zeros((0,) + tuple(self.input_shape), dtype=np.uint8)
            extra_y = np.zeros(0, np.int64)
        arrays = {"device": mask, "device_x": extra, "device_y": extra_y}
        if training.reads_unlabelled:  # the newest images without a label: the priors' EM, the pseudo-labels
            unlabelled = self.store.unlabelled_samples(UNLABELLED_READ)
            arrays["unlabelled_x"] = np.stack(
                [np.load(self.home.root / row.array_path, allow_pickle=False) for row in unlabelled]
            ) if unlabelled else np.zeros((0,) + tuple(self.input_shape), dtype=np.uint8)
        return arrays

    def _follow_worker(self, record: SessionRecord, job_dir: Path, job_path: Path,
                       stop: StopRequest) -> WorkerEnd:
        """Run the worker to its end and fill the record with what it measured."""
        energy_token = self.energy_meter.begin() if self.energy_meter else None
        worker = WorkerRun(self.config.trainer.command(), job_path, job_dir / "worker.stderr")
        record.worker_pid = worker.process.pid
        self.store.save_session(record)
        steps: list[dict[str, Any]] = []
        last_row = [time.monotonic()]

        def on_tick() -> None:
            if self.heartbeat:
                self.heartbeat()
            if len(steps) != (record.steps or 0) and time.monotonic() - last_row[0] > _PROGRESS_ROW_S:
                last_row[0] = time.monotonic()
                record.steps = len(steps)  # progress for `odtctl status` while it runs
                self.store.save_session(record)

        def on_message(message: dict[str, Any]) -> None:
            event = message.get("event")
            if said := precision_said(message):
                self.progress(f"session {record.id}: {said}")
            elif event == "step":
                if not steps or message.get("epoch") != steps[-1].get("epoch"):
                    self.progress(f"session {record.id}: epoch {message.get('epoch', 0) + 1}"
                                  f"/{record.epochs}")
                steps.append(message)
            elif event == "retry":
                self.progress(f"session {record.id}: training diverged at learning rate "
                              f"{message.get('learning_rate'):g} (step "
                              f"{message.get('diverged_at_step')}); training again from its "
                              f"start at {message.get('next_learning_rate'):g}")
            elif event == "eval":
                cached = message.get("cached")
                self.progress(f"session {record.id}: accuracy {message.get('phase')} training "
                              f"{_accuracies(message)} ({message.get('samples')} evaluation "
                              "samples" + (f", {cached} scored in an earlier session"
                                           if cached else "") + ")")

        timeout_s = self.policy.trainer_timeout_s or self.config.trainer.timeout_s
        end = worker.follow(on_message, stop_requested=lambda: stop.reason if stop.is_set() else None,
                            timeout_s=timeout_s, grace_s=self.config.trainer.stop_grace_s,
                            on_tick=on_tick)
        record.duration_s = round(end.duration_s, 3)
        record.steps = len(end.steps)
        record.peak_memory_mb = round(end.peak_rss_mb, 1)
        record.details.min_mem_available_mb = end.min_available_mb
        if self.energy_meter:
            # Also sets each step's energy_j.
            energy = self.energy_meter.end(energy_token, end.steps, WARMUP_STEPS)
            record.details.energy = energy.pop("energy_details")
            for key, value in energy.items():
                setattr(record, key, value)
        if end.steps:
            self.store.add_steps(record.id, end.steps)
            record.throughput_sps = throughput_sps(end.steps)
        if end.result is not None and end.failure is None and not end.stop_reason:
            read_result(record, end.result, self.classes)
            if record.model_version_before == 0 and \
                    record.details.reference_accuracy_before is not None:
                self.repo.keep_origin_eval_cache()  # the worker scored version 0 just now
        self.store.save_session(record)
        return end

    def _finish(self, record: SessionRecord, outcome: Optional[str], reason: Optional[str]
                ) -> SessionRecord:
        record.outcome, record.reason = outcome, reason
        self.store.finish_session(record)
        return self._finished(record)

    def _finished(self, record: SessionRecord) -> SessionRecord:
        _remove_bulky_files(self.home.runs / f"session-{record.id}")
        logger.info("session %d: %s (%s)", record.id, record.outcome, record.reason)
        return record


def _remove_bulky_files(job_dir: Path) -> None:
    # The job file and the worker's stderr stay for diagnosis; data and weights go.
    for name in ("train.npz", "evaluation.npz", "candidate.npz", "global.npz", TRAINED_WEIGHTS,
                 CANDIDATE_EVAL_CACHE):
        (job_dir / name).unlink(missing_ok=True)
    for staged in job_dir.glob(".*.tmp*"):  # a stopped worker's half-written candidate
        staged.unlink(missing_ok=True)
