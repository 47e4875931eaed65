"""What a home's model is: a built-in network or the user's own, and how it is fed and read.

``odtctl init`` records it in the database's meta; every worker job of the home (sessions,
profiles, pre-training, export) gets the same keys from ``ModelSpec.job_keys``. A home made
before models could be imported has no such keys: it is a built-in network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from odtd.errors import ConfigError, ModelError
from odtd.home.paths import Home
from odtd.store.database import Store
from odtd.trainer.protocol import catalog
from odtd.trainer.protocol.job import INPUT_SCALES, OUTPUTS

BUILTIN, IMPORTED = "builtin", "imported"
# Built-in networks scale their own input to 0..1 and end in logits (trainer.models.networks).
BUILTIN_INPUT_SCALE, BUILTIN_OUTPUT = "0-1", "logits"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class ModelSpec:
    """A home's model.

    Attributes:
        name: The directory name under ``models/``: a catalogue name, or the imported model's.
        source: ``builtin`` (the catalogue) or ``imported`` (the user's Keras file).
        classes: Class names in the order of the model's outputs.
        input_shape: (height, width, channels) the model takes.
        input_scale: The pixels the model takes: ``0-255`` (as Keras image pipelines give
            them), ``0-1`` or ``-1-1``.
        output: ``logits`` or ``softmax``: what the last layer gives.
    """

    name: str
    source: str
    classes: list[str]
    input_shape: list[int]
    input_scale: str = BUILTIN_INPUT_SCALE
    output: str = BUILTIN_OUTPUT

    @property
    def imported(self) -> bool:
        """Whether the model came from the user's file."""
        return self.source == IMPORTED

    @classmethod
    def from_store(cls, store: Store) -> ModelSpec:
        """Read the spec ``odtctl init`` stored (a home without one holds a built-in model)."""
        return cls(name=store.meta("model"), source=store.meta("model_source", BUILTIN),
                   classes=store.meta("classes"), input_shape=store.meta("input_shape"),
                   input_scale=store.meta("input_scale", BUILTIN_INPUT_SCALE),
                   output=store.meta("output", BUILTIN_OUTPUT))

    def save(self, store: Store) -> None:
        """Record the spec in the home's meta."""
        store.set_meta(model=self.name, model_source=self.source, classes=self.classes,
                       input_shape=self.input_shape, input_scale=self.input_scale,
                       output=self.output)

    def job_keys(self, home: Home) -> dict[str, Any]:
        """The worker job keys that say which model this is and how it is fed and read."""
        models = home.models / self.name
        return {"architecture": str(models / ARCHITECTURE_NAME) if self.imported else None,
                "input_scale": self.input_scale, "output": self.output}


ARCHITECTURE_NAME = "architecture.json"  # the screened configuration of an imported model
ORIGINAL_STEM = "original"  # the user's file as given: models/<name>/original.keras|.h5


def original_file(model_dir: Any) -> Optional[Any]:
    """The imported model's file as the user gave it, or None."""
    found = sorted(model_dir.glob(ORIGINAL_STEM + ".*"))
    return found[0] if found else None


def check_model_name(name: str) -> None:
    """Raise ModelError when ``name`` is not in the built-in catalogue."""
    if name not in catalog.MODELS:
        known = ", ".join(sorted(catalog.MODELS))
        raise ModelError(f"unknown model {name!r}; known models: {known} (see `odtctl models`), "
                         "or bring your own with --model-file FILE.keras|.h5")


def imported_name(text: Optional[str], file_stem: str = "model") -> str:
    """A safe directory name for an imported model: ``--name`` (``text``) or the file's stem.

    A name taken from the file is made safe here: other characters become ``-``, it is cut to
    55 characters, and a built-in network's name (``xception.keras``) gets ``-imported``.

    Raises:
        ModelError: a ``--name`` that is not up to 64 letters, digits, ``_``, ``.`` or ``-``,
            or one that is a built-in network's.
    """
    if text is None:
        suffix = "-imported"
        name = re.sub(r"[^A-Za-z0-9_.-]+", "-", file_stem).strip("-._") or "model"
        name = name[:64 - len(suffix)]  # _NAME's 64, with room for the suffix
        return name + suffix if name in catalog.MODELS else name
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.") or "model"
    if not _NAME.match(name):
        raise ModelError(f"--name {text!r}: use up to 64 letters, digits, '_', '.' or '-'")
    if name in catalog.MODELS:
        raise ModelError(f"--name {name!r} is a built-in network's name; choose another")
    return name


def check_conventions(input_scale: Optional[str], output: Optional[str]) -> None:
    """Raise ModelError for an ``--input-scale`` or ``--output`` that is not one of the choices."""
    if input_scale is not None and input_scale not in INPUT_SCALES:
        raise ModelError(f"--input-scale {input_scale!r}: choose {', '.join(INPUT_SCALES)}")
    if output is not None and output not in OUTPUTS:
        raise ModelError(f"--output {output!r}: choose {', '.join(OUTPUTS)}")


def parse_classes(text: Optional[str]) -> list[str]:
    """Parse ``--classes a,b,c`` (default: the ten CIFAR-10 classes)."""
    if not text:
        return list(catalog.DEFAULT_CLASSES)
    classes = [name.strip() for name in text.split(",") if name.strip()]
    if len(classes) < 2 or len(set(classes)) != len(classes):
        raise ConfigError(f"--classes {text!r}: give at least two distinct names, comma-separated")
    return classes


def parse_input_size(text: Optional[str]) -> Optional[tuple[int, int]]:
    """Parse ``--input-size HxW`` (height by width) or ``--input-size N`` (N by N), in pixels."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", text)
    if not match or int(match[1]) < 1 or int(match[2] or 1) < 1:
        raise ConfigError(f"--input-size {text!r}: give HEIGHTxWIDTH or one size N for NxN, in "
                          "pixels, e.g. 64x48 or 64")
    return int(match[1]), int(match[2] or match[1])


def builtin_input_shape(model: str, input_size: Optional[tuple[int, int]]) -> list[int]:
    """A built-in network's input shape: its default, or ``input_size`` (height, width).

    Raises:
        ConfigError: the size is below the network's minimum (``catalog.sized_input_shape``).
    """
    if input_size is None:
        return list(catalog.get(model).input_shape)
    try:
        return list(catalog.sized_input_shape(model, *input_size))
    except ValueError as exc:
        least = catalog.get(model).min_input_size
        raise ConfigError(f"--input-size: {exc}; give at least {least}x{least}, or leave "
                          "--input-size out for the default") from None
