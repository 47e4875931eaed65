"""The session record: one typed value that the session fills, the store writes and the CLI prints.

``SessionRecord.to_dict()`` is the session object of the CLI contract (DESIGN.md; docs/cli.md:
``train-now --json``, ``history --json``, ``status --json``'s ``sessions``): the contract keys in
their documented order, then ``trigger``, ``state`` and ``details``. ``SessionDetails`` is what
``details`` holds; a session row stores it as JSON, so a home written by an older release reads
back with the fields it had (the others stay at their defaults) and keys this release does not
know are kept in ``extra``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, List, Optional

# The session object of the CLI contract (DESIGN.md), in its documented order.
SESSION_KEYS = (
    "id", "day", "started_at", "finished_at", "outcome", "reason",
    "model_version_before", "model_version_after", "batch_size", "epochs",
    "samples_new", "samples_replay", "steps", "duration_s", "throughput_sps",
    "accuracy_before", "accuracy_after", "energy_j", "energy_by_rail_j",
    "energy_source", "energy_coverage", "peak_memory_mb",
)
OUTCOMES = ("promoted", "rolled_back", "failed", "interrupted", "skipped")
# The outcomes of a session whose candidate was judged: the kept model is then the one
# ``kept`` names, and its accuracy was measured.
JUDGED = ("promoted", "rolled_back")

# Details keys left out at their defaults: the release that wrote the oldest rows did not have
# them, and reads the same.
_OMITTED_AT_DEFAULT = {"attempts": [], "kept_for_resume": False,
                       "reference_accuracy_before": None, "reference_accuracy_after": None,
                       "reference_paired": None, "reference_paired_origin": None,
                       "bn_device_weight": None,
                       "bn_weights_tried": None, "trained_share": None,
                       "trained_shares_tried": None, "served_share": None,
                       "served_shares_tried": None, "learning_rate": None,
                       "lr_attempts": None, "precision_reason": None, "federated": None,
                       "priors": None, "pseudo_labels": None, "prior_refresh": None}


@dataclass
class SessionDetails:
    """What a session found out beyond the contract keys (the ``details`` object).

    Attributes:
        forced: ``train-now --force`` bypassed the gates.
        resumed: Training went on from the last refused candidate (``training.resume_within``).
        admission: The admission decision (``Admission.to_dict()``): batch, epochs, predictions.
        attempts: Failed worker runs before the last, each ``{batch_size, reason, oom}``.
        evaluation_set: ``validation`` (the fixed set), ``holdout`` (the device's held-out
            samples) or ``none``: what ``accuracy_before``/``accuracy_after`` were measured on.
        precision: What the worker trained in (``auto`` resolved).
        precision_reason: Why ``auto`` resolved so (the worker's words), None for another.
        paired: ``{gained, lost, samples}`` on the evaluation set: the images only the candidate
            gets right, only the served model gets right, and all (McNemar).
        holdout_accuracy_before: The served model on the device's held-out samples (0..1).
        holdout_accuracy_after: The candidate on them.
        reference_accuracy_before: The served model on the reference set (base training
            images held out of ``init --replay``: the original domain), None without one.
        reference_accuracy_after: The candidate on it.
        reference_paired: ``{gained, lost, samples}`` on the reference set.
        reference_paired_origin: The same, the candidate against the home's first model
            (version 0; None until a session that served it has kept its results).
        bn_device_weight: The device's share of the candidate's BatchNorm statistics that
            ``training.bn_device_share: auto`` chose (None otherwise).
        bn_weights_tried: ``auto``'s candidates: weight (a string) -> accuracy by evaluation
            group (``"0"`` validation, ``"1"`` held-out, ``"2"`` reference); a candidate
            never scored in full (worse on validation than the one kept) has no ``"2"``.
        trained_share: The trained weights' share of the candidate (``training.trained_share``
            below 1 or ``auto``; None otherwise): the rest is the served model's.
        trained_shares_tried: ``auto``'s candidates, as ``bn_weights_tried``.
        served_share: A federated round's candidate's share where it was then averaged with
            the device's served model (the rest; None in a local session).
        served_shares_tried: Those tries, as ``bn_weights_tried``.
        per_class_before: Class name -> accuracy of the served model (None: no samples).
        per_class_after: Class name -> accuracy of the candidate.
        forgetting: Best accuracy any kept model had on the evaluation set minus the kept
            model's now (0..1).
        replay_buffer: The reservoir update: ``{added, removed, size}``.
        kept_for_resume: The refused candidate was kept for the next session to go on from.
        min_mem_available_mb: The system's lowest MemAvailable while the worker ran.
        tf_peak_memory_mb: TensorFlow's own peak on a GPU, None on a CPU.
        energy: Mean, peak and idle-baseline power, incremental energy, samples, per-step mean.
        learning_rate: The peak learning rate the session trained at (the policy's, the rate
            remembered for the model after an earlier divergence, or a retry's).
        lr_attempts: The rates whose training diverged, each ``{learning_rate,
            diverged_at_step}`` (``training.diverged_retries``); None where none did.
        federated: A Flower round's session (trigger ``fleet``; docs/fleet.md): ``run_id``,
            ``round``, what the server asked (``epochs``, ``learning_rate``, ``batchnorm``),
            ``handed_back`` (the trained weights went back to the server) and ``already_served``
            (whether the round's model was the served one, then trained and judged as a local
            session); None otherwise.
        priors: The device's class priors the candidate was scored with
            (``training.prior_correction``): ``status`` (``estimated`` or ``skipped`` and
            ``reason``), ``device`` and ``source`` priors, ``temperature``, ``calibrated_on``,
            the images counted (``labelled``, ``unlabelled``); None with the option off.
        pseudo_labels: The device's images without a label the session trained on
            (``training.pseudo_labels``): ``offered``, ``kept``, ``threshold``, ``by_class``;
            or ``status: skipped`` and why; None with the option off.
        prior_refresh: Where the trained candidate was refused, the served model with the
            device's priors estimated anew (``training.prior_correction``): its ``accuracy``,
            the estimate (``priors``) and whether it was ``served`` in the candidate's place (then
            with the candidate's ``candidate_accuracy`` and ``candidate_refusal``); None
            otherwise.
        extra: Keys of a stored row this release does not know, kept as they were.
    """

    forced: bool = False
    resumed: bool = False
    admission: Optional[Dict[str, Any]] = None
    attempts: List[Dict[str, Any]] = field(default_factory=list)
    evaluation_set: Optional[str] = None
    precision: Optional[str] = None
    precision_reason: Optional[str] = None
    paired: Optional[Dict[str, int]] = None
    holdout_accuracy_before: Optional[float] = None
    holdout_accuracy_after: Optional[float] = None
    reference_accuracy_before: Optional[float] = None
    reference_accuracy_after: Optional[float] = None
    reference_paired: Optional[Dict[str, int]] = None
    reference_paired_origin: Optional[Dict[str, int]] = None
    bn_device_weight: Optional[float] = None
    bn_weights_tried: Optional[Dict[str, Dict[str, float]]] = None
    trained_share: Optional[float] = None
    trained_shares_tried: Optional[Dict[str, Dict[str, float]]] = None
    served_share: Optional[float] = None
    served_shares_tried: Optional[Dict[str, Dict[str, float]]] = None
    per_class_before: Optional[Dict[str, Optional[float]]] = None
    per_class_after: Optional[Dict[str, Optional[float]]] = None
    forgetting: Optional[float] = None
    replay_buffer: Optional[Dict[str, int]] = None
    kept_for_resume: bool = False
    min_mem_available_mb: Optional[float] = None
    tf_peak_memory_mb: Optional[float] = None
    energy: Optional[Dict[str, Any]] = None
    learning_rate: Optional[float] = None
    lr_attempts: Optional[List[Dict[str, Any]]] = None
    federated: Optional[Dict[str, Any]] = None
    priors: Optional[Dict[str, Any]] = None
    pseudo_labels: Optional[Dict[str, Any]] = None
    prior_refresh: Optional[Dict[str, Any]] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """Return the ``details`` object (``extra``'s keys beside the known ones).

        ``attempts``, ``kept_for_resume``, the reference figures and ``auto``'s BatchNorm choice
        appear only when a session has them (a retry, a kept candidate, a home with a reference
        set, ``bn_device_share: auto``), as every release wrote them: ``history --json`` of an
        old session reads the same after an upgrade.
        """
        data = asdict(self)
        extra = data.pop("extra")
        for key, default in _OMITTED_AT_DEFAULT.items():
            if data[key] == default:
                del data[key]
        return {**extra, **data}

    @classmethod
    def from_dict(cls, data: Optional[Dict[str, Any]]) -> SessionDetails:
        """Read a stored ``details`` object (missing keys take their defaults)."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)} - {"extra"}
        extra = {key: data.pop(key) for key in list(data) if key not in known}
        return cls(**data, extra=extra)


def kept(outcome: Optional[str], before: Any, after: Any) -> Any:
    """Of a session's before/after figures, the kept model's: after only if it was promoted."""
    return after if outcome == "promoted" else before


@dataclass
class SessionRecord:
    """One session: its trigger, its outcome and everything measured (a ``sessions`` row).

    The contract keys are documented in docs/cli.md (`odtctl train-now`); ``worker_pid`` is
    internal (crash diagnosis) and not part of ``to_dict``.
    """

    day: str
    trigger: str
    id: Optional[int] = None
    state: str = "running"
    started_at: Optional[str] = None
    finished_at: Optional[str] = None
    outcome: Optional[str] = None
    reason: Optional[str] = None
    model_version_before: Optional[int] = None
    model_version_after: Optional[int] = None
    batch_size: Optional[int] = None
    epochs: Optional[int] = None
    samples_new: Optional[int] = None
    samples_replay: Optional[int] = None
    steps: Optional[int] = None
    duration_s: Optional[float] = None
    throughput_sps: Optional[float] = None
    accuracy_before: Optional[float] = None
    accuracy_after: Optional[float] = None
    energy_j: Optional[float] = None
    energy_by_rail_j: Optional[Dict[str, float]] = None
    energy_source: Optional[str] = None
    energy_coverage: Optional[float] = None
    peak_memory_mb: Optional[float] = None
    worker_pid: Optional[int] = None
    details: SessionDetails = field(default_factory=SessionDetails)

    @property
    def kept_accuracy(self) -> Optional[float]:
        """Accuracy of the model kept after this session (a refused candidate's is not kept)."""
        return kept(self.outcome, self.accuracy_before, self.accuracy_after)

    def to_dict(self) -> Dict[str, Any]:
        """Return the contract's session object, plus ``trigger``, ``state`` and ``details``."""
        obj = {key: getattr(self, key) for key in SESSION_KEYS}
        obj.update(trigger=self.trigger, state=self.state, details=self.details.to_dict())
        return obj

    def to_row(self) -> Dict[str, Any]:
        """Return the ``sessions`` table row (JSON text for the nested values)."""
        row = {f.name: getattr(self, f.name) for f in fields(self)}
        row["details"] = json.dumps(self.details.to_dict(), sort_keys=True)
        if self.energy_by_rail_j is not None:
            row["energy_by_rail_j"] = json.dumps(self.energy_by_rail_j, sort_keys=True)
        if self.id is None:
            del row["id"]
        return row

    @classmethod
    def from_row(cls, row: Dict[str, Any]) -> SessionRecord:
        """Read a ``sessions`` table row."""
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in row.items() if key in known}
        rails = values.get("energy_by_rail_j")
        values["energy_by_rail_j"] = json.loads(rails) if rails else None
        details = values.get("details")
        values["details"] = SessionDetails.from_dict(json.loads(details) if details else None)
        return cls(**values)
