"""The training policy, ``policy.yaml``: strict pydantic, the place a person tunes a session."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from odtd.config import describe_validation_error, read_yaml_mapping, renamed_keys
from odtd.errors import PolicyError
from odtd.trainer.protocol.job import LR_SCHEDULES, PRECISIONS

# Policy keys renamed, old -> new: old files keep loading, with one warning line each.
RENAMED_TRAINING_KEYS = {"bn_device_weight": "bn_device_share"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SchedulePolicy(_Strict):
    """When a session trains: overrides of ``odtd.yaml``'s cron, and how many new samples it waits for."""

    cron: Optional[str] = Field(default=None, description="five-field crontab; null keeps odtd.yaml's")
    min_new_samples: PositiveInt = Field(
        default=1, description="a session trains only with at least this many new samples pending")
    backoff: float = Field(
        default=1.0, ge=1, le=16,
        description="after a refused session the next waits for this many times the new samples "
        "it trained on (at most training.max_samples_per_session); 1: off")


class BatchPolicy(_Strict):
    """Batch size, the knob that decides memory (and energy per sample)."""

    size: int = Field(default=16, ge=1, le=4096, description="samples per training step")
    candidates: List[int] = Field(default=[4, 8, 16, 32, 64], description="sizes `profile` tries")
    memory_budget_mb: Optional[float] = Field(
        default=None, gt=0, description="peak worker memory allowed; null = no budget")
    headroom_pct: float = Field(default=15.0, ge=0, lt=100,
                                description="kept free below the budget for prediction error")
    on_oom: Literal["halve", "skip"] = "halve"
    precisions: Optional[List[Literal[PRECISIONS]]] = Field(  # type: ignore[valid-type]
        default=None, description="precisions admission may choose among, each as profiled "
        "(`odtctl profile --precisions`); null = training.precision alone")

    @field_validator("candidates")
    @classmethod
    def _positive(cls, value: List[int]) -> List[int]:
        if not value or any(size < 1 for size in value):
            raise ValueError(f"{value} must be a non-empty list of sizes >= 1")
        return sorted(set(value))


class EnergyPolicy(_Strict):
    """The energy budget of one session."""

    budget_j: Optional[float] = Field(default=None, gt=0, description="joules per session; null = none")
    on_over_budget: Literal["fewer_epochs", "smaller_batch", "skip"] = "fewer_epochs"


class GatesPolicy(_Strict):
    """Conditions for a session to start and to go on (checked every ``check_interval_s``)."""

    require_charging: bool = False
    min_battery_pct: Optional[float] = Field(default=None, ge=0, le=100)
    max_temp_c: Optional[float] = Field(default=None, gt=0, lt=150)
    max_system_load: Optional[float] = Field(default=None, gt=0,
                                             description="1-minute load average per core")
    min_idle_s: Optional[float] = Field(default=None, ge=0,
                                        description="seconds since the last user input")
    window: Optional[str] = Field(default=None, description='local time window, e.g. "01:00-06:00"')
    check_interval_s: float = Field(default=5.0, gt=0)

    @field_validator("window")
    @classmethod
    def _window(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            parse_window(value)
        return value


class TrainingPolicy(_Strict):
    """How a session trains on its samples.

    The defaults are the recipe for small daily data: a low learning rate, few epochs, light
    augmentation, and BatchNorm statistics frozen so that tiny batches cannot wreck them.
    """

    epochs: int = Field(default=3, ge=1, le=1000)
    optimizer: Literal["sgd", "adam"] = "sgd"
    learning_rate: float = Field(default=0.005, gt=0, le=10)
    lr_schedule: Literal[LR_SCHEDULES] = Field(  # type: ignore[valid-type]
        default="constant", description="cosine: the rate decays to 0 over each session's steps")
    momentum: float = Field(default=0.9, ge=0, lt=1)
    clip_norm: Optional[float] = Field(
        default=1.0, gt=0, description="clip each step's gradient to this global norm (every "
        "optimizer): a step of a model the rate was not chosen for cannot blow up the weights; "
        "null = off")
    diverged_retries: int = Field(
        default=2, ge=0, le=10, description="when the loss diverges (not finite, or 100 times "
        "its start), the session "
        "trains again from where its training began at diverged_lr_factor times the rate, up "
        "to this many times; the rate that trained is remembered for the model and later "
        "sessions start there (until training.learning_rate is changed); 0 = refuse the session")
    diverged_lr_factor: float = Field(
        default=0.1, gt=0, lt=1, description="the learning rate of each retry after a "
        "divergence, as a share of the rate that diverged")
    augment: bool = True
    freeze_bn: bool = Field(default=True, description="BatchNorm in inference mode while training")
    recalibrate_bn: bool = Field(
        default=False, description="after training, recompute BatchNorm's moving statistics over the "
        "session's images under the trained weights (ignored with freeze_bn)")
    bn_device_share: Optional[Union[Literal["auto"], float]] = Field(
        default="auto", description="adapt BatchNorm's statistics to the device's "
        "camera, label-free: before and after training, every BatchNorm layer (frozen ones "
        "too) takes the statistics of a mixture, this share from the device's images (the "
        "day's and up to 512 earlier ones) and the rest from the rehearsed images of the "
        "original domain; replaces recalibrate_bn; 1 = the device's alone (AdaBN); auto = "
        "after training, try 0, 0.25, 0.5, 0.75 and 1 on the evaluation set and keep the best "
        "on validation that loses at most acceptance.reference_tolerance on the reference set "
        "(0.5 while training); null = off")
    distill: float = Field(
        default=0.0, ge=0, le=100, description="hold the original domain by distillation: "
        "each rehearsed image of the replay seed also pulls the candidate toward the served "
        "model's own prediction for it (soft targets at temperature 2, computed once before "
        "training), with this weight beside its label's loss; 0 = off")
    trained_share: Union[Literal["auto"], float] = Field(
        default=1.0, description="the candidate is this share of the trained weights and the "
        "rest of the served model's (BatchNorm statistics too): keeps part of what the session "
        "gained and more of what the served model knew; over days of promotions, a moving "
        "average of the days' candidates; auto = try 0.25, 0.5, 0.75 and 1 (a fleet's round: "
        "0 too, its global model as it came) on the evaluation "
        "set and keep the best on validation that loses at most "
        "acceptance.reference_tolerance on the reference set; 1 = the trained weights as they are")
    round_trained_share: Union[Literal["auto"], float, None] = Field(
        default=None, description="trained_share in a fleet's round instead: 0 = the device "
        "serves the round's model as the fleet sent it (its own update goes to the server "
        "only), judged by acceptance.round_confidence_z; a number = that share of the "
        "device's update; auto = try 0, 0.25, 0.5, 0.75 and 1; null = trained_share")
    federated_mix: bool = Field(
        default=False, description="in a fleet's round (trained_share auto): the candidate, "
        "the round's model plus this device's update, is then averaged with the model this "
        "device serves too, at the share that scores best on its validation images (1 = as it "
        "was): the global and the device's own model mixed, as APFL does; docs/fleet.md")
    bn_class_balanced: bool = Field(
        default=False, description="with bn_device_share: measure the device's statistics "
        "class by class (by the images' labels) and weigh every class alike, so that a run of "
        "one class or an uneven mix does not set the statistics every class is normalised by")
    prior_correction: bool = Field(
        default=False, description="estimate the device's class priors from its images (EM on "
        "the candidate's outputs, calibrated on the reference set, else on the rehearsed "
        "images; labelled images counted by their labels) and keep them with the version as "
        "an offset on its logits: the device's images are scored with it, the reference set "
        "without; guarded like any candidate; the served model with the priors estimated "
        "anew is served where it scores higher (docs/priors.md)")
    balanced_loss: bool = Field(
        default=False, description="train as if the session's images were evenly mixed: the "
        "log of their class frequencies is added to the logits the loss reads (logit "
        "adjustment), so the weights do not learn the device's uneven mix from its labels; "
        "with prior_correction its offset then adds the mix once (docs/priors.md)")
    pseudo_labels: Optional[float] = Field(
        default=None, ge=0, le=1, description="train on the device's images without a label "
        "too, labelled by the served model where it is this sure (its mean probability over "
        "the image and its mirror image, both giving the same class; the class priors of "
        "prior_correction applied), the surest first, at most as many as the session's "
        "labelled images; guarded like any candidate; null = off")
    trainable: Union[Literal["all", "head", "batchnorm"], PositiveInt] = Field(
        default="all", description="what trains: all, head (the last layer that holds weights), "
        "batchnorm (the BatchNorm layers' scale and offset alone), or the last N layers that "
        "hold weights; the rest stays as loaded (BatchNorm included)")
    max_samples_per_session: int = Field(default=512, ge=1)
    resume_within: Optional[float] = Field(
        default=None, ge=0, le=100,
        description="train each session from the last candidate, promoted or not, while it "
        "scores no more than this many points below the served model (gains too small for "
        "one session's guard add up over days; the device keeps serving current); null = "
        "every session starts from current")
    precision: Literal[PRECISIONS] = "fp32"  # type: ignore[valid-type]
    recompute: Union[Literal["off", "on", "auto"], float] = Field(
        default="off", description="gradient checkpointing: recompute activations in the "
        "backward pass instead of keeping them (less memory, more time); on = every segment "
        "but the last, a number from 0 to 1 = the segments in that share of the network from "
        "the input (they hold a convolutional network's largest activations: most of the "
        "saving for part of the time), auto = admission uses whichever profiled share, or none, "
        "is the cheapest plan that fits the memory budget (profile them with "
        "`odtctl profile --recompute off,0.5,on`)")
    micro_batch_size: Union[Literal["off", "auto"], PositiveInt] = Field(
        default="off", description="run each batch as micro-batches of this many samples and "
        "sum their gradients: the same update at a micro-batch's memory; auto = admission "
        "splits a batch that fits no other way into the largest candidate size that fits "
        "(only with freeze_bn: a BatchNorm that trains would normalise each micro-batch alone)")
    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any, info: ValidationInfo) -> Any:
        return renamed_keys("training", data, info, RENAMED_TRAINING_KEYS)

    @field_validator("bn_device_share", "round_trained_share", mode="before")
    @classmethod
    def _share_or_auto(cls, value: object) -> object:
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError("must be a number from 0 to 1, auto or null")
        return float(value)

    @field_validator("trained_share", mode="before")
    @classmethod
    def _trained_share(cls, value: object) -> object:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError("must be a number above 0 and at most 1, or auto")
        return float(value)

    @field_validator("recompute", "micro_batch_size", mode="before")
    @classmethod
    def _yaml_switch(cls, value: object) -> object:
        """YAML reads a bare ``on`` / ``off`` as true / false: take them as the words meant."""
        if value is True:
            return "on"
        if value is False:
            return "off"
        return value

    @field_validator("recompute")
    @classmethod
    def _recompute_share(cls, value: object) -> object:
        if isinstance(value, float) and not 0 < value <= 1:
            raise ValueError("must be off, on, auto or a share of the network above 0 and at "
                             "most 1")
        return value

    gpu_memory_limit_mb: Optional[int] = Field(
        default=None, ge=64, description="cap on TensorFlow's GPU memory (a TX2 shares 8 GB with "
        "the device's own application); null = grow on demand, never grab it all")
    eval_batch_size: Optional[int] = Field(
        default=None, ge=1, description="evaluation batch size; null = batch.size (memory as profiled)")
    seed: int = 0

    @property
    def reads_unlabelled(self) -> bool:
        """Whether a session's train file carries images without a label.

        For the class priors' EM and the pseudo-labels.
        """
        return self.prior_correction or self.pseudo_labels is not None

    @property
    def reads_device_images(self) -> bool:
        """Whether a session's train file carries the device's earlier images.

        For BatchNorm adaptation, distillation, and the labels the class priors and the
        pseudo-labels count.
        """
        return self.bn_device_share is not None or bool(self.distill) or self.reads_unlabelled


class ReplayPolicy(_Strict):
    """Rehearsal of earlier samples, mixed into each session against forgetting."""

    ratio: float = Field(default=1.0, ge=0, le=100, description="replay samples per new sample")
    capacity_samples: int = Field(default=2000, ge=0)
    capacity_mb: Optional[float] = Field(default=None, gt=0,
                                         description="cap on the stored originals of the buffer")
    max_samples: int = Field(default=512, ge=0, description="cap on replay samples per session")
    device_share: float = Field(
        default=0.0, ge=0, le=1,
        description="share of each session's replay drawn first from the device's own earlier "
        "images in the buffer (a random sample of them), the rest class-balanced over the whole "
        "buffer; 0 = class-balanced over the whole buffer, where a large seed of base training "
        "images leaves the device's earlier days almost never rehearsed")


class AcceptancePolicy(_Strict):
    """When a candidate replaces the served model."""

    tolerance: float = Field(
        default=1.0, ge=0, le=100,
        description="largest allowed drop in validation accuracy, in percentage points",
    )
    confidence_z: float = Field(
        default=0.0, ge=0, le=5,
        description="promote only if the candidate's gain minus this many standard errors of "
        "the paired difference (same validation images, both models) is above -tolerance; "
        "0 = compare the two accuracies as measured")
    round_confidence_z: Optional[float] = Field(
        default=None, ge=0, le=5,
        description="a federated round's model as the fleet sent it (the round's candidate at "
        "trained_share 0) is judged by this many standard errors instead of confidence_z: it "
        "learned from the fleet's labels, none of them in this device's validation set; the "
        "reference set is checked as for any candidate; null = confidence_z")
    reference_tolerance: Optional[float] = Field(
        default=1.0, ge=0, le=100,
        description="largest drop, in points, allowed on the reference set (base training "
        "images `init --replay` held out: the original domain); with confidence_z the drop "
        "must exceed it by that many standard errors to refuse; nor may a candidate score "
        "more than this below the home's first model (version 0) there, by the same rule; "
        "null = not checked")


class ModelsPolicy(_Strict):
    """Model version retention."""

    keep_versions: int = Field(default=10, ge=2, description="versions kept on disk (current and "
                               "its parent always are)")


class Policy(_Strict):
    """Everything in ``policy.yaml``."""

    schedule: SchedulePolicy = SchedulePolicy()
    objective: Literal["energy", "time", "balanced"] = "energy"
    objective_eta: float = Field(default=0.5, ge=0, le=1,
                                 description="balanced: eta x energy + (1-eta) x max_power x time")
    batch: BatchPolicy = BatchPolicy()
    energy: EnergyPolicy = EnergyPolicy()
    gates: GatesPolicy = GatesPolicy()
    models: ModelsPolicy = ModelsPolicy()
    training: TrainingPolicy = TrainingPolicy()
    replay: ReplayPolicy = ReplayPolicy()
    acceptance: AcceptancePolicy = AcceptancePolicy()
    trainer_timeout_s: Optional[float] = Field(default=None, gt=0)


def parse_window(text: str) -> tuple[int, int]:
    """Parse "HH:MM-HH:MM" into minutes after midnight (start, end); the window may wrap midnight."""
    parts = text.split("-")
    if len(parts) != 2:
        raise ValueError(f"{text!r} is not a window like '01:00-06:00'")
    minutes = []
    for part in parts:
        hour, _, minute = part.strip().partition(":")
        if not (hour.isdigit() and minute.isdigit() and int(hour) < 24 and int(minute) < 60):
            raise ValueError(f"{text!r} is not a window like '01:00-06:00'")
        minutes.append(int(hour) * 60 + int(minute))
    if minutes[0] == minutes[1]:
        raise ValueError(f"{text!r} is an empty window")
    return minutes[0], minutes[1]


def load_policy(path: Path, missing_ok: bool = True) -> Policy:
    """Load and validate a policy file; a missing file is the default policy if ``missing_ok``.

    Raises:
        PolicyError: one line per problem, each naming the file, the key and the value.
    """
    if not path.exists() and missing_ok:
        return Policy()
    data = read_yaml_mapping(path, PolicyError)
    try:
        policy = Policy.model_validate(data, context={"path": str(path)})
    except ValidationError as exc:
        raise PolicyError(describe_validation_error(path, exc)) from None
    if policy.schedule.cron:
        from odtd.daemon.scheduler import validate_cron

        problem = validate_cron(policy.schedule.cron)
        if problem:
            raise PolicyError(f"{path}: schedule.cron={policy.schedule.cron!r}: {problem}")
    if policy.training.trainable == "batchnorm" and policy.training.freeze_bn:
        raise PolicyError(f"{path}: training.trainable=batchnorm trains only BatchNorm, which "
                          "training.freeze_bn=true freezes: set freeze_bn: false")
    return policy


@dataclass(frozen=True)
class Recipe:
    """The policy ``odtctl init`` installs for a model, and why, in one line."""

    name: str  # the file in policies/ it ships as
    text: str
    why: str


def recipe_for(model: Optional[str] = None, imported: bool = False,
               batchnorm: bool = True) -> Recipe:
    """The commented policy ``odtctl init`` installs for a built-in ``model`` or an imported one.

    An imported model (``init --model-file``: a user's classifier, trained on a server, now
    behind the device's camera) gets ``policies/new-camera.yaml`` (packaged as
    ``odtd/default_policy_imported.yaml``), the recipe measured best on imported models; one
    without BatchNormalization layers (``batchnorm`` False) gets
    ``policies/new-camera-no-batchnorm.yaml``, whose sessions train its weights longer, for it
    has no statistics to adapt. A built-in network with a recipe of its own has
    ``policies/<model>.yaml`` (packaged as ``odtd/default_policy_<model>.yaml``); any other
    gets ``policies/default.yaml``.
    """
    here = Path(__file__).parent
    if imported and not batchnorm:
        return Recipe("new-camera-no-batchnorm.yaml", (
            here / "default_policy_imported_no_batchnorm.yaml").read_text(encoding="utf-8"),
            "the recipe for a model without BatchNormalization that now sees through the "
            "device's camera (imported with --model-file)")
    if imported:
        return Recipe("new-camera.yaml", (here / "default_policy_imported.yaml").read_text(
            encoding="utf-8"), "the recipe for a model trained on a server that now sees "
            "through the device's camera (imported with --model-file)")
    own = here / f"default_policy_{model}.yaml"
    if model and own.exists():
        return Recipe(f"{model}.yaml", own.read_text(encoding="utf-8"),
                      f"the built-in {model}'s own recipe")
    return Recipe("default.yaml", (here / "default_policy.yaml").read_text(encoding="utf-8"),
                  "the default recipe for a built-in network")


def default_policy_text(model: Optional[str] = None) -> str:
    """Return the commented default policy that ``odtctl init`` writes for a built-in ``model``."""
    return recipe_for(model).text
