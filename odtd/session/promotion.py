"""The end of a session: promote the candidate or roll it back, all or nothing.

Acceptance (``acceptance.refusal_reason``) decides; this module carries the decision out. Every
database change (the replay buffer's update, the samples marked trained, the new version's row,
the finished session row) is one transaction, and the ``current`` pointer moves last inside it.
Files that only make sense once the database says so (the candidate kept for resuming, the
candidate's evaluation results, pruning) move after the commit. If anything fails before the
commit, the new version's directory is removed and nothing else has changed: the served model,
its versions, the samples and the replay buffer are as they were.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

from odtd.errors import OdtdError, failure_reason
from odtd.home.paths import Home
from odtd.home.replay_buffer import update_buffer
from odtd.home.versions import ModelRepo, prune
from odtd.policy import Policy
from odtd.session.acceptance import reference_refusal, refusal_reason
from odtd.session.federated import trains_from_round
from odtd.session.result import PriorRefresh, read_prior_refresh
from odtd.store.database import Store
from odtd.store.records import JUDGED, SessionDetails, SessionRecord
from odtd.trainer.protocol.launch import diverged
from odtd.trainer.protocol.paired import round_model_as_sent

logger = logging.getLogger(__name__)

CANDIDATE_EVAL_CACHE = "candidate-eval-cache.npz"  # worker job key eval_cache_out


def fleet_model_as_sent(details: SessionDetails) -> bool:
    """Whether a session's candidate is its federated round's global model as it came.

    That is the round's try at ``trained_share`` 0 (``averaging.ROUND_SHARES``), not averaged
    with the served model after (``served_share`` 1 or none): the acceptance test then reads
    ``acceptance.round_confidence_z`` where the policy sets it.
    """
    return trains_from_round(details.federated) and round_model_as_sent(details.trained_share,
                                                                        details.served_share)


class Promotion:
    """Concludes sessions of one home's model.

    Args:
        home: The state directory.
        store: Its open database.
        repo: The model's versions.
        policy: The active policy (acceptance, replay, resume and retention settings).
        progress: Called with one-line progress messages.
    """

    def __init__(self, home: Home, store: Store, repo: ModelRepo, policy: Policy,
                 progress: Callable[[str], None]) -> None:
        self.home, self.store, self.repo, self.policy = home, store, repo, policy
        self.progress = progress

    def conclude(self, record: SessionRecord, pending: list[dict[str, Any]], job_dir: Path,
                 result: dict[str, Any]) -> None:
        """Promote the candidate in ``job_dir`` or roll it back; finish ``record`` either way.

        Raises:
            Exception: Whatever failed before the outcome was committed; then nothing of this
                session was written (the caller records the session as failed). After the
                commit, a failure to tidy up (the eval cache, the resumable candidate, pruning)
                is logged: the outcome stands.
        """
        current = record.model_version_before
        before, after = record.accuracy_before, record.accuracy_after
        acceptance = self.policy.acceptance
        refusal = diverged(result)  # then the worker wrote no candidate
        details = record.details
        as_sent = fleet_model_as_sent(details)
        if refusal is None and before is not None and after is not None:
            refusal = refusal_reason(
                before, after, acceptance.tolerance / 100.0,
                acceptance.round_confidence_z if as_sent and acceptance.round_confidence_z
                is not None else acceptance.confidence_z, details.paired)
        if refusal is None and acceptance.reference_tolerance is not None and \
                details.reference_accuracy_before is not None:
            refusal = "the candidate was not scored on the reference set" \
                if details.reference_accuracy_after is None else reference_refusal(
                details.reference_accuracy_before, details.reference_accuracy_after,
                acceptance.reference_tolerance / 100.0, acceptance.confidence_z,
                details.reference_paired, self.store.reference_origin(),
                details.reference_paired_origin)
        record.details.forgetting = self._forgetting(before, before if refusal else after)
        candidate = job_dir / "candidate.npz"
        refreshed = read_prior_refresh(result, self.store.meta("classes")) \
            if current is not None else None
        if refreshed is not None:
            details.prior_refresh = {"accuracy": refreshed.accuracy, "served": False,
                                     "priors": refreshed.priors}
            anew = refreshed.accuracy  # the served model with the new priors
            beaten = refusal is not None or (after is not None and anew is not None and anew > after)
            if beaten and before is not None and anew is not None and anew > before:
                record.details.kept_for_resume = self._resumable(candidate, before, after)
                self._promote_refreshed(record, pending, result, refusal, refreshed, candidate)
                return
        if refusal:
            record.details.kept_for_resume = self._resumable(candidate, before, after)
            record.outcome, record.reason = "rolled_back", refusal + "; kept the served model"
            self._commit(record, pending, new_version=None, manifest=None)
            self._settled(record, self._after_refusal, record, candidate)
            return
        version = self._promote(
            record, pending, result, candidate, result.get("logit_offset_after"), move=True,
            basis=result.get("logit_offset_basis_after"),
            reason=("accepted: the round's model as the fleet sent it" if as_sent else "accepted")
            if before is not None else "no evaluation data: promoted unguarded")
        self._settled(record, self._after_promotion, record, job_dir, version)

    def _promote(self, record: SessionRecord, pending: list[dict[str, Any]],
                 result: dict[str, Any], weights: Path, logit_offset: Optional[list[float]],
                 move: bool, reason: str, basis: Optional[dict[str, Any]] = None) -> int:
        """Store ``weights`` as the next version, commit the session promoted; the version.

        ``logit_offset`` and its ``basis`` (what it was estimated with) go to its manifest.

        The record's ``accuracy_after`` is the new version's. A failed commit removes the
        version again, and the pointer stays where it was.
        """
        current = record.model_version_before
        version, manifest = self.repo.add_version(
            weights, classes=self.store.meta("classes"), input_shape=self.store.meta("input_shape"),
            param_count=result.get("param_count"), parent=current, session_id=record.id,
            metrics={"accuracy": record.accuracy_after}, weight_names=result.get("weight_names"),
            logit_offset=logit_offset, move=move, logit_offset_basis=basis)
        record.outcome, record.reason, record.model_version_after = "promoted", reason, version
        try:
            self._commit(record, pending, new_version=version, manifest=manifest)
        except BaseException:
            self._discard(version, current)
            raise
        return version

    def _promote_refreshed(self, record: SessionRecord, pending: list[dict[str, Any]],
                           result: dict[str, Any], refusal: Optional[str],
                           refreshed: PriorRefresh, candidate: Path) -> None:
        """Serve the served weights with the device's priors estimated anew, as a new version.

        The served model with a new offset (``priors.refresh_served``) scored higher on the
        group the acceptance test reads than the served model and than the trained candidate,
        which was refused (``refusal``; None: it would have passed, but scored lower). Its gain
        over the served model is judged as measured, not by ``acceptance.confidence_z``: the
        offset is estimated from the device's labelled images, none of them in the evaluation
        set, and each day's labels make the estimate better; the check is that it does not
        lose there. Its weights are the served ones, so the reference set scores as before.
        """
        details = record.details
        candidate_accuracy = record.accuracy_after
        details.prior_refresh.update(served=True, candidate_accuracy=candidate_accuracy,
                                     candidate_refusal=refusal)
        record.accuracy_after = refreshed.accuracy
        details.holdout_accuracy_after = refreshed.holdout_accuracy
        details.reference_accuracy_after = details.reference_accuracy_before
        details.paired, details.reference_paired = refreshed.paired, None
        details.per_class_after = refreshed.per_class
        details.forgetting = self._forgetting(record.accuracy_before, refreshed.accuracy)
        version = self._promote(
            record, pending, result, self.repo.weights_path(record.model_version_before),
            refreshed.logit_offset, move=False, basis=refreshed.basis,
            reason="the device's class priors estimated anew: the served model with "
                   + ("its offset carried to them " if refreshed.priors.get("offset") == "carried"
                      else "them ")
                   + f"{refreshed.accuracy:.2%} vs {record.accuracy_before:.2%}; the trained "
                   + (f"candidate was refused ({refusal})" if refusal is not None else
                      f"candidate scored {candidate_accuracy:.2%}"))
        self._settled(record, self._after_refresh, record, candidate, version)

    def _resumable(self, candidate: Path, before: Optional[float], after: Optional[float]
                   ) -> bool:
        """Whether a refused candidate is kept for the next session to go on from."""
        within = self.policy.training.resume_within
        return within is not None and candidate.exists() and after is not None and \
            before is not None and after >= before - within / 100.0

    def _after_refusal(self, record: SessionRecord, candidate: Path) -> None:
        if record.details.kept_for_resume:
            self.repo.keep_for_resume(candidate)
        else:
            self.repo.clear_resume()

    def _after_promotion(self, record: SessionRecord, job_dir: Path, version: int) -> None:
        self.repo.adopt_eval_cache(job_dir / CANDIDATE_EVAL_CACHE)
        self.repo.clear_resume()  # the promoted candidate is current: go on from there
        self._promoted(record, version)

    def _after_refresh(self, record: SessionRecord, candidate: Path, version: int) -> None:
        # The new version's weights are the ones the eval cache was scored on, but not its
        # offset: the cache is dropped. The refused candidate may still be gone on from.
        self.repo.adopt_eval_cache(None)
        self._after_refusal(record, candidate)
        self._promoted(record, version)

    def _promoted(self, record: SessionRecord, version: int) -> None:
        self.store.log_event("promoted", f"{self.repo.name} v{version} is current",
                             session_id=record.id)
        pruned = prune(self.home, self.store, keep=self.policy.models.keep_versions)
        if pruned:
            self.progress(f"pruned model versions {', '.join(f'v{v}' for v in pruned)}")

    @staticmethod
    def _settled(record: SessionRecord, step: Callable[..., None], *args: Any) -> None:
        """Run what follows the commit; a failure here is logged, never the session's.

        The outcome stands (a failure on a full or read-only disk would undo nothing of it).
        """
        try:
            step(*args)
        except (OSError, OdtdError) as exc:
            logger.warning("session %d %s; what follows failed: %s", record.id, record.outcome,
                           failure_reason(exc))

    def _commit(self, record: SessionRecord, pending: list[dict[str, Any]],
                new_version: Optional[int], manifest: Optional[dict[str, Any]]) -> None:
        """Write the session's outcome in one transaction; the pointer moves last, inside it."""
        with self.store.transaction():
            record.details.replay_buffer = update_buffer(
                self.store, self.policy.replay, pending, record.id, self.home.root)
            self.store.mark_trained([row["sha256"] for row in pending], record.id)
            if new_version is not None and manifest is not None:
                self.store.add_model_version({
                    "model": self.repo.name, "version": new_version,
                    "parent": record.model_version_before, "session_id": record.id,
                    "sha256": manifest["sha256"], "param_count": manifest["param_count"],
                    "accuracy": record.accuracy_after})
            self.store.finish_session(record)
            if new_version is not None:
                self.repo.set_current(new_version)

    def _discard(self, version: int, current: Optional[int]) -> None:
        """Undo a promotion whose transaction failed: the pointer back, the new version gone."""
        try:
            if current is not None and self.repo.current() != current:
                self.repo.set_current(current)
            self.repo.remove_version(version)
        except OSError:
            logger.exception("could not remove %s v%d after a failed promotion", self.repo.name,
                             version)

    def _forgetting(self, before: Optional[float], kept_now: Optional[float]) -> Optional[float]:
        """Best accuracy any kept model had on the evaluation set, minus the kept one's now."""
        if before is None or kept_now is None:
            return None
        earlier = [s.kept_accuracy for s in self.store.sessions(done_only=True)
                   if s.outcome in JUDGED]
        best = max([before] + [a for a in earlier if a is not None])
        return round(max(0.0, best - kept_now), 4)

