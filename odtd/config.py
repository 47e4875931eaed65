"""The daemon configuration, ``odtd.yaml``: strict, every error names the file and key."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from odtd.errors import ConfigError

logger = logging.getLogger(__name__)


def renamed_keys(section: str, data: Any, info: ValidationInfo, renames: Dict[str, str],
                 values: Optional[Dict[str, Dict[Any, Any]]] = None) -> Any:
    """Map a section's old spellings to their new names, logging one deprecation line each.

    For a ``model_validator(mode="before")``: old files keep loading, and say what to change.

    Args:
        section: The section's key in the file (``training``, ``telemetry``), for the messages.
        data: The section as read (a mapping; anything else is left to pydantic).
        info: Pydantic's validation info; ``info.context["path"]`` names the file.
        renames: Old key -> new key.
        values: New key -> {old value: new value}: renamed values of a key.

    Raises:
        ValueError: the section gives an old key and its new one both.
    """
    if not isinstance(data, dict):
        return data
    where = (info.context or {}).get("path", "the configuration")
    for old, new in renames.items():
        if old not in data:
            continue
        if new in data:
            raise ValueError(f"{section}.{old} and {section}.{new} are the same setting: keep "
                             f"{section}.{new} alone")
        logger.warning("%s: %s.%s is deprecated: rename it %s.%s (same value)", where, section,
                       old, section, new)
        data = {(new if key == old else key): value for key, value in data.items()}
    for key, renamed in (values or {}).items():
        value = data.get(key)
        if isinstance(value, str) and value in renamed:
            logger.warning("%s: %s.%s: %s is deprecated: write %s", where, section, key, value,
                           renamed[value])
            data = dict(data, **{key: renamed[value]})
    return data

DEFAULT_HOME = Path("/var/lib/odtd")
CONFIG_NAME = "odtd.yaml"
# How an image of another shape reaches the model's input; odtd.home.images implements them.
ResizeMode = Literal["stretch", "crop", "pad"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScheduleConfig(_Strict):
    """When sessions run.

    Attributes:
        cron: five-field crontab expression in local time (minute hour day month weekday).
        jitter_s: random delay added to each run, so a fleet does not train in lockstep.
        misfire_grace_s: how late a missed run may still start (board was off at 02:00).
    """

    cron: str = "0 2 * * *"
    jitter_s: int = Field(default=300, ge=0)
    misfire_grace_s: int = Field(default=12 * 3600, ge=1)

    @field_validator("cron")
    @classmethod
    def _five_fields(cls, value: str) -> str:
        if len(value.split()) != 5:
            raise ValueError(
                f"{value!r} is not a five-field cron expression such as '0 2 * * *'"
            )
        return value


class InboxConfig(_Strict):
    """The spool directory watcher."""

    scan_interval_s: float = Field(default=10.0, gt=0)


class TrainerConfig(_Strict):
    """How the trainer worker is launched.

    Attributes:
        python: interpreter for the worker (a TX2 runs JetPack's python3.6 with NVIDIA's
            TensorFlow while the daemon runs python3.8); default: the daemon's own.
        timeout_s: a session's worker is stopped after this long.
        stop_grace_s: after a stop request, how long before terminate, then kill.
    """

    python: Optional[str] = None
    timeout_s: float = Field(default=4 * 3600, gt=0)
    stop_grace_s: float = Field(default=20.0, gt=0)

    def command(self, module: str = "odtd.trainer.worker") -> list[str]:
        """Return the argv prefix that runs the worker module (or another of the trainer's).

        ``python`` imports the daemon's own odtd package and nothing else of its environment
        (``odtd.trainer.protocol.launch.module_command``): no hand-made path is needed.
        """
        from odtd.trainer.protocol.launch import module_command

        return module_command(self.python, module)


class TelemetryConfig(_Strict):
    """Power and memory sampling."""

    backend: str = "auto"
    interval_ms: float = Field(default=10.0, gt=0)
    sampler_nice: int = Field(
        default=10, ge=0, le=19,
        description="added to the sampler thread's nice value, so it does not preempt training")
    playback_file: Optional[str] = Field(
        default=None, description="the recording the playback backend plays")
    playback_interval_ms: Optional[float] = Field(
        default=None, gt=0, description="interval of a played-back tegrastats log without timestamps")

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any, info: ValidationInfo) -> Any:
        # Power-recording playback was first called replay, the rehearsal buffer's name.
        return renamed_keys("telemetry", data, info,
                            {"replay_file": "playback_file",
                             "replay_interval_ms": "playback_interval_ms"},
                            {"backend": {"replay": "playback"}})

    @model_validator(mode="after")
    def _playback_needs_file(self) -> TelemetryConfig:
        if self.backend == "playback" and not self.playback_file:
            raise ValueError("backend 'playback' needs telemetry.playback_file (a .jsonl "
                             "recording or a tegrastats log)")
        return self


class ImagesConfig(_Strict):
    """How an image file becomes the model's input: ingest, ``init --validation``, ``--replay``.

    The defaults give the pixels ``keras.utils.image_dataset_from_directory`` gives a model with
    its own defaults, so images from the device's camera look to the model like the ones it
    was trained on. Set this before ``odtctl init``: the validation set and the replay seed are
    decoded then, and a later change applies to new samples only.

    Attributes:
        resize: ``stretch`` resizes to the input's height and width, whatever the aspect ratio
            (Keras's default); ``crop`` takes the largest centred box of the input's aspect
            ratio, then resizes (Keras's ``crop_to_aspect_ratio=True``); ``pad`` resizes to fit
            inside and centres on black (``pad_to_aspect_ratio=True``).
        antialias: false samples bilinearly between the 4 nearest pixels, as ``tf.image.resize``
            does for ``image_dataset_from_directory``; true averages over each output pixel's
            whole footprint (Pillow's bilinear filter), as ``keras.utils.load_img(...,
            interpolation="bilinear")`` and ``tf.image.resize(antialias=True)`` do.
    """

    resize: ResizeMode = Field(
        default="stretch",
        description="stretch | crop | pad: how an image of another aspect ratio reaches the "
                    "model's input size (stretch: as Keras's image_dataset_from_directory does "
                    "by default)")
    antialias: bool = Field(
        default=False,
        description="false: bilinear as tf.image.resize (image_dataset_from_directory); true: "
                    "Pillow's area-averaging bilinear, as keras.utils.load_img")


PruneKind = Literal["runs", "unlabelled", "versions", "samples"]
PRUNE_ORDER: tuple[str, ...] = ("runs", "unlabelled", "versions", "samples")


class StorageConfig(_Strict):
    """The home's disk: the free space odtd keeps, and what it may delete to keep it.

    Below the floor an ingest refuses (the files stay where they are) and a session that would
    not fit is skipped, after odtd pruned what ``prune`` allows (``odtd.home.disk``).

    Attributes:
        min_free_mb: the floor, in MB (1024 * 1024 bytes) left free on the home's filesystem
            after any write odtd makes; room for SQLite, the logs and the rest of the system.
        prune: what odtd may delete to get back above the floor, always in this order: ``runs``
            (old ``runs/`` folders: job files and worker logs), ``unlabelled`` (the oldest
            unlabelled samples beyond the newest 2048 a session reads), ``versions`` (model
            versions beyond the policy's ``models.keep_versions``), ``samples`` (the oldest
            trained samples that neither the replay buffer nor a session still reads). Never
            the served model, its parent, a pending or held-out sample, or the replay buffer.
    """

    min_free_mb: float = Field(
        default=256.0, ge=0,
        description="free space (MB) odtd keeps on the home's filesystem: below it ingest "
                    "refuses and sessions that would not fit are skipped")
    prune: List[PruneKind] = Field(  # typing.List: pydantic evaluates it on Python 3.8
        default_factory=lambda: ["runs", "unlabelled", "versions"],
        description="what odtd may delete to stay above min_free_mb, applied in the order runs, "
                    "unlabelled, versions, samples (unlabelled: the oldest images without a "
                    "label that no session reads any more; samples: the oldest trained ones the "
                    "replay buffer does not hold)")

    @field_validator("prune")
    @classmethod
    def _no_repeats(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"{value}: name each of {', '.join(PRUNE_ORDER)} at most once")
        return value


class MetricsConfig(_Strict):
    """Prometheus textfile export (node_exporter's textfile collector)."""

    textfile: Optional[str] = None


class Config(_Strict):
    """Everything in ``odtd.yaml``."""

    schedule: ScheduleConfig = ScheduleConfig()
    inbox: InboxConfig = InboxConfig()
    trainer: TrainerConfig = TrainerConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    images: ImagesConfig = ImagesConfig()
    metrics: MetricsConfig = MetricsConfig()
    storage: StorageConfig = StorageConfig()
    policy: str = "policy.yaml"
    heartbeat_interval_s: float = Field(default=5.0, gt=0)


def resolve_home(home: str | os.PathLike[str] | None = None) -> Path:
    """Return the state directory: ``home``, else ``$ODTD_HOME``, else /var/lib/odtd."""
    if home:
        return Path(home).expanduser().resolve()
    env = os.environ.get("ODTD_HOME")
    if env:
        return Path(env).expanduser().resolve()
    return DEFAULT_HOME


def describe_validation_error(path: Path, error: ValidationError) -> str:
    """Turn pydantic's error list into ``file: key=value: problem`` lines."""
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key {key!r}; remove it or check its spelling")
            continue
        value = item.get("input")
        shown = "" if isinstance(value, dict) else f"={value!r}"
        message = item["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, "):]
        lines.append(f"{path}: {key}{shown}: {message}")
    return "\n".join(lines)


def read_yaml_mapping(path: Path, error_cls: type[Exception]) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping (an empty file is an empty mapping)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error_cls(f"{path}: no such file") from None
    except OSError as exc:
        raise error_cls(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise error_cls(f"{path}:{where} is not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise error_cls(f"{path}: expected a mapping of keys at the top, got {type(data).__name__}")
    return data


def load_config(path: Path) -> Config:
    """Load and validate ``odtd.yaml``; a missing file means all defaults.

    Raises:
        ConfigError: naming the file, the key and the value.
    """
    if not path.exists():
        return Config()
    data = read_yaml_mapping(path, ConfigError)
    try:
        config = Config.model_validate(data, context={"path": str(path)})
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(path, exc)) from None
    _check_cron(path, config.schedule.cron)
    return config


def _check_cron(path: Path, cron: str) -> None:
    # The daemon's scheduler module owns apscheduler; importing it lazily keeps
    # `odtctl status` fast, and validates the expression exactly as it will run.
    from odtd.daemon.scheduler import validate_cron

    problem = validate_cron(cron)
    if problem:
        raise ConfigError(f"{path}: schedule.cron={cron!r}: {problem}")


def default_config_text() -> str:
    """Return the commented ``odtd.yaml`` that ``odtctl init`` writes."""
    return """\
# odtd daemon configuration. Unknown keys are errors. Times are local.
schedule:
  cron: "0 2 * * *"        # minute hour day month weekday: every day at 02:00
  jitter_s: 300             # random delay so a fleet does not train in lockstep
  misfire_grace_s: 43200    # a board that was off at 02:00 still trains within 12 h
inbox:
  scan_interval_s: 10       # how often inbox/<label>/ is scanned
trainer:
  python: null              # worker interpreter; null = the daemon's own
  timeout_s: 14400          # a session's worker is stopped after 4 h
  stop_grace_s: 20          # stop request -> terminate -> kill
telemetry:
  backend: auto             # auto | jtop | ina3221 | tegrastats | rapl | estimate | none | playback
  interval_ms: 10
  sampler_nice: 10          # the sampler thread's nice above the daemon's: it reads
                            # in training's gaps instead of preempting a step
images:                     # set before `odtctl init`: the validation and replay images are read then
  resize: stretch           # stretch | crop | pad: how an image of another aspect ratio reaches
                            # the model's input (stretch, crop_to_aspect_ratio, pad_to_aspect_ratio
                            # of keras.utils.image_dataset_from_directory; stretch is its default)
  antialias: false          # false: bilinear as image_dataset_from_directory (tf.image.resize);
                            # true: Pillow's area-averaging bilinear, as keras.utils.load_img
storage:                    # the home's disk (docs/jetson.md, "A data disk for the home")
  min_free_mb: 256          # free space kept: below it ingest refuses, sessions that would not fit skip
  prune: [runs, unlabelled, versions]   # what odtd may delete to stay above it (unlabelled:
                            # images without a label no session reads any more; add samples:
                            # the oldest trained samples the replay buffer does not hold)
policy: policy.yaml         # relative to ODTD_HOME, or an absolute path
heartbeat_interval_s: 5
"""
