"""The fleet server's YAML: how many rounds, which devices, what each trains, where rounds go.

    rounds: 6                 # Flower rounds
    strategy: fedavg          # fedavg | fedavgm (server momentum: server_momentum) | fedprox
    proximal_mu: 0.01         # fedprox: the proximal term's weight in each device's loss
    fraction: 1.0             # share of the connected devices asked each round
    evaluate_fraction: 0.0    # share asked, after each round, to score its model on their own
                              # samples (Flower's evaluate round); 0: none
    min_devices: 2            # at least this many asked; a round waits for them to connect
    local_epochs: 1           # each device's epochs per round (None: its policy's admission)
    learning_rate: null       # the devices' rate (None: each policy's)
    batchnorm: fedavg         # fedavg: BatchNorm parameters averaged | fedbn: kept per device
    round_timeout_s: 600      # replies later than this are counted as "no reply"
    initial_weights: base.npz # the model every device starts from (a version's weights.npz)
    record: rounds.db         # the SQLite record of rounds (relative: beside this file)
    output_weights: null      # where the last global weights go (default: beside the record)

Relative paths are taken from the YAML file's directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from odtd.config import describe_validation_error, read_yaml_mapping
from odtd.errors import ConfigError


class FleetSettings(BaseModel):
    """The server's settings (see the module docstring for each key)."""

    model_config = ConfigDict(extra="forbid")

    rounds: int = Field(3, ge=1)
    strategy: Literal["fedavg", "fedavgm", "fedprox"] = "fedavg"
    proximal_mu: float = Field(0.01, ge=0.0)
    server_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    server_learning_rate: float = Field(1.0, gt=0.0)
    fraction: float = Field(1.0, gt=0.0, le=1.0)
    evaluate_fraction: float = Field(0.0, ge=0.0, le=1.0)
    min_devices: int = Field(2, ge=1)
    local_epochs: Optional[int] = Field(1, ge=1)
    learning_rate: Optional[float] = Field(None, gt=0.0)
    batchnorm: Literal["fedavg", "fedbn"] = "fedavg"
    round_timeout_s: float = Field(600.0, gt=0.0)
    initial_weights: Path
    record: Path = Path("fleet-rounds.db")
    output_weights: Optional[Path] = None


def load_settings(path: Path) -> FleetSettings:
    """Read and check the server's YAML; relative paths become relative to its directory.

    Raises:
        ConfigError: One line per problem, naming the file, the key and the value.
    """
    data = read_yaml_mapping(path, ConfigError)
    try:
        settings = FleetSettings.model_validate(data, context={"path": str(path)})
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(path, exc)) from None
    base = path.resolve().parent
    for key in ("initial_weights", "record", "output_weights"):
        value = getattr(settings, key)
        if value is not None and not value.is_absolute():
            setattr(settings, key, base / value)
    if not settings.initial_weights.exists():
        raise ConfigError(f"{path}: initial_weights={str(settings.initial_weights)!r}: no such file; "
                          "give a version's weights.npz (odtctl models versions)")
    if settings.output_weights is None:
        settings.output_weights = settings.record.with_name(settings.record.stem + "-global.npz")
    return settings
