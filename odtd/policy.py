"""The training policy, ``policy.yaml``: strict pydantic, the place a person tunes a session."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from odtd.config import describe_validation_error, read_yaml_mapping
from odtd.errors import PolicyError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchPolicy(_Strict):
    """Batch size, the knob that decides memory (and energy per sample)."""

    size: int = Field(default=16, ge=1, description="samples per training step")


class TrainingPolicy(_Strict):
    """How a session trains on its samples.

    The defaults are the recipe for small daily data: a low learning rate, few epochs, light
    augmentation, and BatchNorm statistics frozen so that tiny batches cannot wreck them.
    """

    epochs: int = Field(default=3, ge=1, le=1000)
    optimizer: Literal["sgd", "adam"] = "sgd"
    learning_rate: float = Field(default=0.005, gt=0, le=10)
    momentum: float = Field(default=0.9, ge=0, lt=1)
    augment: bool = True
    freeze_bn: bool = Field(default=True, description="BatchNorm in inference mode while training")
    max_samples_per_session: int = Field(default=512, ge=1)
    precision: Literal["fp32", "mixed_float16", "mixed_bfloat16", "auto"] = "fp32"
    seed: int = 0


class ReplayPolicy(_Strict):
    """Rehearsal of earlier samples, mixed into each session against forgetting."""

    ratio: float = Field(default=1.0, ge=0, le=20, description="replay samples per new sample")
    capacity_samples: int = Field(default=2000, ge=0)
    max_samples: int = Field(default=512, ge=0, description="cap on replay samples per session")


class AcceptancePolicy(_Strict):
    """When a candidate replaces the current model."""

    tolerance: float = Field(
        default=1.0, ge=0, le=100,
        description="largest allowed drop in validation accuracy, in percentage points",
    )


class Policy(_Strict):
    """Everything in ``policy.yaml``."""

    batch: BatchPolicy = BatchPolicy()
    training: TrainingPolicy = TrainingPolicy()
    replay: ReplayPolicy = ReplayPolicy()
    acceptance: AcceptancePolicy = AcceptancePolicy()
    trainer_timeout_s: Optional[float] = Field(default=None, gt=0)


def load_policy(path: Path, missing_ok: bool = True) -> Policy:
    """Load and validate a policy file; a missing file is the default policy if ``missing_ok``.

    Raises:
        PolicyError: one line per problem, each naming the file, the key and the value.
    """
    if not path.exists() and missing_ok:
        return Policy()
    data = read_yaml_mapping(path, PolicyError)
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(describe_validation_error(path, exc)) from None


def default_policy_text() -> str:
    """Return the commented default policy that ``odtctl init`` writes (= policies/default.yaml)."""
    return (Path(__file__).with_name("default_policy.yaml")).read_text(encoding="utf-8")
