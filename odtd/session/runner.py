"""One training session: samples in, a worker run, guarded promotion, one sessions row out.

The runner is shared by ``odtctl train-now --foreground``, ``odtctl simulate`` and the daemon.
A session never leaves a broken model behind: the worker writes a candidate; only a candidate
that passes acceptance becomes a new version and ``current``; a crash, kill or timeout of the
worker leaves the current model and the pending samples as they were.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import signal
import threading
import time
from contextlib import nullcontext
from datetime import date
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from odtd.config import Config
from odtd.errors import SessionBusy, TrainerFailed
from odtd.home.ingest import load_sample_arrays
from odtd.home.paths import Home
from odtd.home.versions import ModelRepo, prune
from odtd.policy import Policy
from odtd.session.acceptance import refusal_reason
from odtd.session.admission import SKIP, admit_session, oom_retry_batch, record_oom
from odtd.session.gates import FORCE_CLOSED_FILE, GateMonitor, check_gates
from odtd.session.replay_buffer import choose_replay, update_buffer
from odtd.store.database import Store
from odtd.trainer.launch import WARMUP_STEPS, WorkerRun, failure_reason, worker_ran_out_of_memory

logger = logging.getLogger(__name__)

GROUP_VALIDATION, GROUP_HOLDOUT = 0, 1  # evaluation groups (docs/worker-protocol.md)
_POLL_S = 0.2
CANDIDATE_EVAL_CACHE = "candidate-eval-cache.npz"  # worker job key eval_cache_out


class SessionLock:
    """An exclusive ``flock`` on ``run/session.lock``: one session at a time across processes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: Optional[int] = None

    def __enter__(self) -> SessionLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o660)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise SessionBusy(f"a session is already running (pid {holder}); wait for it to finish") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


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
        self.model = store.meta("model")
        self.classes = store.meta("classes")
        self.input_shape = store.meta("input_shape")
        self.repo = ModelRepo(home.models, self.model)
        self.root = root
        self.force_file = home.run / FORCE_CLOSED_FILE

    def run(self, trigger: str = "cli", day: Optional[str] = None,
            stop: Optional[threading.Event] = None, force: bool = False) -> dict[str, Any]:
        """Run one session and return its session object.

        Args:
            trigger: what started it (cli, schedule, socket, simulate).
            day: YYYY-MM-DD the session belongs to (default: today).
            stop: set it to stop the worker at its next step boundary (outcome interrupted).
            force: bypass the policy's gates (never the memory budget or the OOM rules).

        Raises:
            SessionBusy: another session holds the lock.
        """
        with SessionLock(self.home.session_lock):
            recover_stale_sessions(self.store)
            return self._run_locked(trigger, day or date.today().isoformat(),
                                    stop or threading.Event(), force)

    def _run_locked(self, trigger: str, day: str, stop: threading.Event, force: bool) -> dict[str, Any]:
        policy = self.policy
        current = self.repo.current()
        self.repo.verify(current)
        pending = self.store.samples("pending", limit=policy.training.max_samples_per_session)
        session_id = self.store.start_session(
            day, trigger, model_version_before=current, batch_size=policy.batch.size,
            epochs=policy.training.epochs,
        )
        skip = {"outcome": "skipped", "model_version_after": current}
        if not pending:
            return self._finish(session_id, reason="no pending samples", samples_new=0,
                                samples_replay=0, **skip)
        closed = [] if force else [g for g in check_gates(policy.gates, self.root, None, self.force_file)
                                   if not g.passed]
        if closed:
            return self._finish(session_id, reason=f"gate {closed[0].name} closed: {closed[0].reason}",
                                samples_new=0, samples_replay=0, **skip)
        replay_rows = choose_replay(self.store, policy.replay, len(pending), seed=session_id)
        counts = {"samples_new": len(pending), "samples_replay": len(replay_rows)}
        admission = admit_session(self.store, policy, samples=len(pending) + len(replay_rows))
        # Resuming trains on from the last refused candidate, always judged against current.
        resume = policy.training.resume_within is not None and self.repo.resume_path.exists()
        details: dict[str, Any] = {"admission": admission.to_dict(), "forced": force,
                                   "resumed": resume}
        if admission.decision == SKIP:
            return self._finish(session_id, reason=admission.reason, details=details,
                                batch_size=admission.batch_size, epochs=admission.epochs,
                                **counts, **skip)
        job_dir = self.home.runs / f"session-{session_id}"
        job_dir.mkdir(parents=True, exist_ok=True)
        batch_size, attempts = admission.batch_size, []
        try:
            while True:
                self.progress(f"session {session_id}: {len(pending)} new + {len(replay_rows)} "
                              f"replay samples, batch {batch_size}, {admission.epochs} epochs; "
                              "worker starting")
                self.store.update_session(session_id, batch_size=batch_size, epochs=admission.epochs)
                job_path, eval_name = self._write_job(job_dir, current, pending + replay_rows,
                                                      batch_size, admission.epochs, resume)
                try:
                    with self._gate_monitor(stop, force):
                        outcome = self._train(session_id, job_dir, job_path, stop)
                    break
                except TrainerFailed as exc:
                    retry = self._after_oom(exc, batch_size, stop)
                    attempts.append({"batch_size": batch_size, "reason": str(exc), "oom": exc.oom})
                    if retry is None:
                        details["attempts"] = attempts
                        return self._finish(session_id, outcome="failed", reason=str(exc),
                                            model_version_after=current, details=details, **counts)
                    self.progress(f"session {session_id}: out of memory at batch {batch_size}; "
                                  f"retrying at batch {retry} (on_oom: halve)")
                    batch_size = retry
        except BaseException as exc:
            # Record before propagating: a session row must never stay `running` by our hand.
            self._finish(session_id, outcome="failed", reason=f"internal error: {exc!r}",
                         model_version_after=current, **counts)
            raise
        outcome.update(counts)
        details.update(outcome.get("details", {}), evaluation_set=eval_name)
        if attempts:
            details["attempts"] = attempts
        outcome["details"] = details
        if outcome.get("outcome") == "interrupted":
            outcome["model_version_after"] = current
            return self._finish(session_id, **outcome)
        return self._accept(session_id, current, pending, job_dir, outcome)

    def _gate_monitor(self, stop: threading.Event, force: bool) -> Any:
        if force:
            return nullcontext()
        return GateMonitor(self.policy.gates, stop, root=self.root, force_file=self.force_file)

    def _after_oom(self, exc: TrainerFailed, batch_size: int, stop: threading.Event) -> Optional[int]:
        """Apply ``batch.on_oom`` to a failed attempt; return the batch to retry at, or None."""
        if not exc.oom or stop.is_set():
            return None
        record_oom(self.store, self.model, batch_size)
        return oom_retry_batch(self.policy.batch, batch_size)

    def _write_job(self, job_dir: Path, current: int, rows: list[dict[str, Any]], batch_size: int,
                   epochs: int, resume: bool) -> tuple[Path, str]:
        x, y = load_sample_arrays(self.home, rows, self.classes)
        np.savez(job_dir / "train.npz", x=x, y=y)
        eval_name, validation = self._write_evaluation_set(job_dir)
        training = self.policy.training
        current_weights = str(self.repo.weights_path(current))
        job = {
            "protocol": 1, "mode": "train", "model": self.model, "classes": self.classes,
            "input_shape": self.input_shape,
            "weights_in": str(self.repo.resume_path) if resume else current_weights,
            "baseline_weights": current_weights if resume else None,
            "weights_out": str(job_dir / "candidate.npz"),
            "train_data": str(job_dir / "train.npz"),
            "validation_data": str(validation) if validation else None,
            "batch_size": batch_size, "epochs": epochs, "max_steps": None,
            "optimizer": training.optimizer, "learning_rate": training.learning_rate,
            "lr_schedule": training.lr_schedule,
            "momentum": training.momentum, "augment": training.augment,
            "freeze_bn": training.freeze_bn, "recalibrate_bn": training.recalibrate_bn,
            "seed": training.seed, "parent_pid": os.getpid(),
            "precision": training.precision, "gpu_memory_limit_mb": training.gpu_memory_limit_mb,
            "eval_batch_size": training.eval_batch_size,
            "eval_cache": str(self.repo.eval_cache_path),
            # The candidate's results, adopted as the eval cache if it is promoted.
            "eval_cache_out": str(job_dir / CANDIDATE_EVAL_CACHE),
        }  # fmt: skip
        job_path = job_dir / "job.json"
        job_path.write_text(json.dumps(job, indent=2), encoding="utf-8")
        return job_path, eval_name

    def _write_evaluation_set(self, job_dir: Path) -> tuple[str, Optional[Path]]:
        """Write the evaluation ``.npz``: validation set (group 0), then held-out samples (group 1).

        Acceptance uses group 0 when it exists, else group 1.
        """
        parts = []
        if self.home.validation_file().exists():
            with np.load(self.home.validation_file(), allow_pickle=False) as data:
                parts.append((data["x"], data["y"], GROUP_VALIDATION))
        holdout = self.store.samples("holdout")
        if holdout:
            hx, hy = load_sample_arrays(self.home, holdout, self.classes)
            parts.append((hx, hy, GROUP_HOLDOUT))
        if not parts:
            return "none", None
        path = job_dir / "evaluation.npz"
        np.savez(path, x=np.concatenate([p[0] for p in parts]),
                 y=np.concatenate([p[1] for p in parts]),
                 group=np.concatenate([np.full(len(p[1]), p[2], dtype=np.int64) for p in parts]))
        return ("validation" if parts[0][2] == GROUP_VALIDATION else "holdout"), path

    def _train(self, session_id: int, job_dir: Path, job_path: Path,
               stop: threading.Event) -> dict[str, Any]:
        """Run the worker to its end; return partial session fields.

        Raises:
            TrainerFailed: the worker crashed, was killed, timed out or reported an error.
        """
        timeout_s = self.policy.trainer_timeout_s or self.config.trainer.timeout_s
        grace_s = self.config.trainer.stop_grace_s
        energy_token = self.energy_meter.begin() if self.energy_meter else None
        started = time.monotonic()
        worker = WorkerRun(self.config.trainer.command(), job_path, job_dir / "worker.stderr")
        self.store.update_session(session_id, worker_pid=worker.process.pid)
        steps: list[dict[str, Any]] = []
        result: Optional[dict[str, Any]] = None
        error: Optional[dict[str, Any]] = None
        stop_sent_at: Optional[float] = None
        stop_reason = None
        eof = False
        worker_ready = False
        last_progress = started
        try:
            while not eof or worker.process.poll() is None:
                worker.sample_memory()
                if steps and time.monotonic() - last_progress > 2.0:
                    # Progress for `odtctl status` while the session runs.
                    last_progress = time.monotonic()
                    self.store.update_session(session_id, steps=len(steps))
                if self.heartbeat:
                    self.heartbeat()
                now = time.monotonic()
                # SIGUSR1 before the worker's "start" line could arrive before its handler is
                # installed and kill it outright; wait for the line (kill escalation still runs).
                timed_out = now - started > timeout_s
                if stop_sent_at is None and (worker_ready or timed_out) and (stop.is_set() or timed_out):
                    stop_reason = (getattr(stop, "reason", None) or "stop requested") if stop.is_set() \
                        else f"timed out after {timeout_s:.0f} s"
                    worker.signal(signal.SIGUSR1)
                    stop_sent_at = now
                elif stop_sent_at is not None and now - stop_sent_at > 2 * grace_s:
                    worker.signal(signal.SIGKILL)
                elif stop_sent_at is not None and now - stop_sent_at > grace_s:
                    worker.signal(signal.SIGTERM)
                if eof:
                    time.sleep(_POLL_S)
                    continue
                try:
                    message = worker.lines.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if message is None:
                    eof = True
                elif message.get("event") == "start":
                    worker_ready = True
                elif message.get("event") == "step":
                    if not steps or message.get("epoch") != steps[-1].get("epoch"):
                        self.progress(f"session {session_id}: epoch {message.get('epoch', 0) + 1}"
                                      f"/{self.policy.training.epochs}")
                    steps.append(message)
                elif message.get("event") == "eval":
                    cached = message.get("cached")
                    self.progress(f"session {session_id}: accuracy {message.get('phase')} training "
                                  f"{message.get('accuracy', 0) * 100:.1f}% on {message.get('samples')} "
                                  "evaluation samples" + (f" ({cached} scored in an earlier session)"
                                                          if cached else ""))
                elif message.get("event") == "result":
                    result = message
                elif message.get("event") == "error":
                    error = message
        finally:
            worker.close()
        duration_s = time.monotonic() - started
        returncode = worker.process.returncode
        fields: dict[str, Any] = {"duration_s": round(duration_s, 3), "steps": len(steps),
                                  "peak_memory_mb": round(worker.peak_rss_mb, 1)}
        details: dict[str, Any] = {"min_mem_available_mb": worker.min_available_mb}
        if self.energy_meter:
            energy = self.energy_meter.end(energy_token, steps)  # also sets each step's energy_j
            details["energy"] = energy.pop("energy_details")
            fields.update(energy)
        if steps:
            self.store.add_steps(session_id, steps)
            fields["throughput_sps"] = throughput_sps(steps)
        fields["details"] = details
        if result and result.get("peak_rss_mb"):
            fields["peak_memory_mb"] = round(max(worker.peak_rss_mb, result["peak_rss_mb"]), 1)
        if stop_reason and (result is None or result.get("status") == "interrupted"):
            fields.update(outcome="interrupted", reason=stop_reason)
            self.store.update_session(session_id, **fields)
            return fields
        if error is not None or result is None or returncode != 0:
            self.store.update_session(session_id, **fields)
            raise TrainerFailed(failure_reason(returncode, error, job_dir / "worker.stderr"),
                                oom=worker_ran_out_of_memory(error, returncode, worker.oom_kills_at_start))
        before = result.get("by_group_before") or {}
        after = result.get("by_group_after") or {}
        primary = str(GROUP_VALIDATION) if str(GROUP_VALIDATION) in before else str(GROUP_HOLDOUT)
        fields.update(
            accuracy_before=before.get(primary, result.get("accuracy_before")),
            accuracy_after=after.get(primary, result.get("accuracy_after")),
            _result=result,
        )
        details.update(holdout_accuracy_before=before.get(str(GROUP_HOLDOUT)),
                       holdout_accuracy_after=after.get(str(GROUP_HOLDOUT)),
                       paired=(result.get("paired_by_group") or {}).get(primary))
        details.update(
            per_class_before=_by_class(self.classes, result.get("per_class_before")),
            per_class_after=_by_class(self.classes, result.get("per_class_after")),
            precision=result.get("precision"), tf_peak_memory_mb=result.get("tf_peak_memory_mb"),
        )
        return fields

    def _accept(self, session_id: int, current: int, pending: list[dict[str, Any]],
                job_dir: Path, fields: dict[str, Any]) -> dict[str, Any]:
        result = fields.pop("_result")
        before, after = fields.get("accuracy_before"), fields.get("accuracy_after")
        acceptance = self.policy.acceptance
        tolerance = acceptance.tolerance / 100.0
        shas = [row["sha256"] for row in pending]
        fields["details"]["replay_buffer"] = update_buffer(
            self.store, self.policy.replay, pending, session_id, self.home.root)
        refusal = None
        if before is not None and after is not None:
            refusal = refusal_reason(before, after, tolerance, acceptance.confidence_z,
                                     fields["details"].get("paired"))
        fields["details"]["forgetting"] = self._forgetting(before, before if refusal else after)
        if refusal:
            with self.store.transaction():
                self.store.mark_trained(shas, session_id)
                session = self._finish_refused(session_id, job_dir, before, after,
                                               reason=refusal + "; kept the current model",
                                               outcome="rolled_back", model_version_after=current,
                                               **fields)
            return session
        version, manifest = self.repo.add_version(
            job_dir / "candidate.npz", classes=self.classes, input_shape=self.input_shape,
            param_count=result.get("param_count"), parent=current, session_id=session_id,
            metrics={"accuracy": after}, weight_names=result.get("weight_names"), move=True,
        )
        # Before _finish clears the job directory. Should the promotion fail, the cache is
        # another model's and simply not used.
        self.repo.adopt_eval_cache(job_dir / CANDIDATE_EVAL_CACHE)
        reason = "accepted" if before is not None else "no evaluation data: promoted unguarded"
        with self.store.transaction():
            self.store.add_model_version({
                "model": self.model, "version": version, "parent": current,
                "session_id": session_id, "sha256": manifest["sha256"],
                "param_count": manifest["param_count"], "accuracy": after,
            })  # fmt: skip
            self.store.mark_trained(shas, session_id)
            session = self._finish(session_id, outcome="promoted", reason=reason,
                                   model_version_after=version, **fields)
            # The pointer moves last, inside the transaction: if it fails, nothing is recorded.
            self.repo.set_current(version)
        self.repo.clear_resume()  # the promoted candidate is current: go on from there
        self.store.log_event("promoted", f"{self.model} v{version} is current", session_id=session_id)
        pruned = prune(self.home, self.store, keep=self.policy.models.keep_versions)
        if pruned:
            self.progress(f"pruned model versions {', '.join(f'v{v}' for v in pruned)}")
        return session

    def _finish_refused(self, session_id: int, job_dir: Path, before: float, after: float,
                        **fields: Any) -> dict[str, Any]:
        """Finish a rolled-back session, keeping its candidate to resume from if the policy says so."""
        within = self.policy.training.resume_within
        candidate = job_dir / "candidate.npz"
        if within is not None and after >= before - within / 100.0 and candidate.exists():
            self.repo.keep_for_resume(candidate)
            fields["details"]["kept_for_resume"] = True
        else:
            self.repo.clear_resume()
        return self._finish(session_id, **fields)

    def _forgetting(self, before: Optional[float], kept_now: Optional[float]) -> Optional[float]:
        """Best accuracy any kept model had on the evaluation set, minus the kept one's now."""
        if before is None or kept_now is None:
            return None
        earlier = [s["accuracy_after"] if s["outcome"] == "promoted" else s["accuracy_before"]
                   for s in self.store.sessions(done_only=True)
                   if s["outcome"] in ("promoted", "rolled_back")]
        best = max([before] + [a for a in earlier if a is not None])
        return round(max(0.0, best - kept_now), 4)

    def _finish(self, session_id: int, **fields: Any) -> dict[str, Any]:
        self.store.finish_session(session_id, **fields)
        _remove_bulky_files(self.home.runs / f"session-{session_id}")
        session = self.store.session(session_id)
        logger.info("session %d: %s (%s)", session_id, session["outcome"], session["reason"])
        return session


def _by_class(classes: list[str], values: Optional[list[Optional[float]]]) -> Optional[dict[str, Any]]:
    return dict(zip(classes, values)) if values is not None else None


def _remove_bulky_files(job_dir: Path) -> None:
    # The job file and the worker's stderr stay for diagnosis; data and weights go.
    for name in ("train.npz", "candidate.npz", "candidate.npz.tmp", CANDIDATE_EVAL_CACHE):
        (job_dir / name).unlink(missing_ok=True)
    (job_dir / "evaluation.npz").unlink(missing_ok=True)


def recover_stale_sessions(store: Store) -> list[int]:
    """Mark sessions left ``running`` by a dead process as interrupted; return their ids.

    Call it only while holding the session lock: then no live process can own such a row.
    Their samples were never marked trained, so they stay pending.
    """
    stale = [row["id"] for row in store.running_sessions()]
    for session_id in stale:
        store.finish_session(
            session_id, outcome="interrupted",
            reason="the process running this session died (crash, kill or power loss); "
                   "its samples stay pending",
        )  # fmt: skip
        store.log_event("recovered", f"session {session_id} marked interrupted", session_id=session_id)
        logger.warning("session %d was left running by a dead process: marked interrupted", session_id)
    return stale


def throughput_sps(steps: list[dict[str, Any]]) -> Optional[float]:
    """Samples per second over the steps after the warm-up (all steps if there are few)."""
    measured = steps[WARMUP_STEPS:] if len(steps) > WARMUP_STEPS else steps
    seconds = sum(s["end"] - s["start"] for s in measured)
    samples = sum(s["batch_size"] for s in measured)
    return round(samples / seconds, 3) if seconds > 0 else None
