"""Camera shifts: a device's camera that sees the world unlike the server's training images.

Each shift maps uint8 images, one ``(height, width, channels)`` or a batch ``(n, height, width,
channels)`` with 1 or 3 channels, to images of the same shape and dtype. Random parts (sensor
noise, a rotation's angle) come from ``seed``: the same images and seed give the same result.
``odtctl simulate --shift NAME`` and ``scripts/reproduce_tx2_daily.py --shift NAME`` apply one
to the device's images (its daily stream, its held-out samples, its validation set), never to
the server's pre-training or replay images.

The suite, in ``SHIFTS`` (figures in grey levels of 0-255):

- ``low_light``: a third of the light (x0.35) with sensor noise that grows with the signal
  (shot noise, variance 1 x level, plus read noise of 4).
- ``dusk``: darker, bluer and noisier: red x0.42, green x0.50, blue x0.65, the same noise.
- ``colour_cast``: tungsten white balance: red x1.15, blue x0.70 (a 1-channel image sees only
  its effect on luma).
- ``blur``: a defocused lens, Gaussian of radius 1.2 pixels (Pillow).
- ``fog``: low contrast: 55% of every pixel is a light grey haze (190).
- ``rotate``: a camera mounted askew, 5-12 degrees either way per image, zoomed in so no
  corner is empty (bilinear).
- ``jpeg``: JPEG at quality 12 (Pillow's encoder), its 8x8 blocks and lost detail.

A camera not in the suite: ``A+B`` applies shifts in turn (``dusk+jpeg``), and
``FILE.py:NAME`` (or ``module:NAME``) is your own, a ``Shift`` or a function
``(batch, rng) -> batch`` (``get_shift``).

Numpy and Pillow only: this runs in the CLI process, which never imports TensorFlow (a shift of
your own runs there too).
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, Union

import numpy as np
from PIL import Image, ImageFilter

from odtd.errors import ConfigError

Seed = Union[int, Sequence[int]]
# Image.Resampling appeared in Pillow 9.1; 9.0 has the constant on Image itself.
_BILINEAR = getattr(Image, "Resampling", Image).BILINEAR
_LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R 601-2, Pillow's convert("L")
_CHUNK_IMAGES = 1024


@dataclass(frozen=True)
class Shift:
    """One named camera shift.

    Attributes:
        name: what ``--shift`` takes.
        description: a few words for ``--shift help``.
        transform: ``(batch uint8 (n, h, w, c), rng) -> batch`` of the same shape, any dtype
            that holds 0-255 (the result is rounded and clipped to uint8).
    """

    name: str
    description: str
    transform: Callable[[np.ndarray, np.random.Generator], np.ndarray]

    def __call__(self, images: np.ndarray, seed: Seed = 0) -> np.ndarray:
        """Shift ``images`` (uint8 (h, w, c) or (n, h, w, c), c 1 or 3); return new uint8 images.

        Raises:
            ValueError: not uint8, or not (h, w, 1|3) / (n, h, w, 1|3).
        """
        images = np.asarray(images)
        if images.dtype != np.uint8 or images.ndim not in (3, 4) or images.shape[-1] not in (1, 3):
            raise ValueError(f"shift {self.name}: expected uint8 images (h, w, 1|3) or "
                             f"(n, h, w, 1|3); got {images.dtype} {images.shape}")
        batch = images if images.ndim == 4 else images[np.newaxis]
        rng = np.random.default_rng(seed)
        out = np.empty_like(batch)
        # In blocks, drawing from one generator in order: float temporaries stay small (10,000
        # CIFAR images at once would need about 400 MB) and the result does not depend on them.
        for start in range(0, len(batch), _CHUNK_IMAGES):
            shifted = self.transform(batch[start:start + _CHUNK_IMAGES], rng)
            out[start:start + _CHUNK_IMAGES] = np.clip(np.rint(shifted), 0, 255)
        return out if images.ndim == 4 else out[0]


def _gains(batch: np.ndarray, rgb: Sequence[float]) -> np.ndarray:
    """Multiply each channel; a 1-channel image gets the gains' effect on luma."""
    gains = np.asarray(rgb, dtype=np.float32)
    if batch.shape[-1] == 1:
        gains = np.float32(_LUMA @ gains)[np.newaxis]
    return batch.astype(np.float32) * gains


def _sensor_noise(level: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Shot noise grows with the light a pixel caught; read noise does not (a dim photo is grainy).
    sigma = np.sqrt(16.0 + np.clip(level, 0, None))
    return level + rng.standard_normal(level.shape, dtype=np.float32) * sigma.astype(np.float32)


def _low_light(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return _sensor_noise(_gains(batch, (0.35, 0.35, 0.35)), rng)


def _dusk(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return _sensor_noise(_gains(batch, (0.42, 0.50, 0.65)), rng)


def _colour_cast(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return _gains(batch, (1.15, 1.0, 0.70))


def _fog(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return 0.45 * batch.astype(np.float32) + 0.55 * 190.0


def _per_image(batch: np.ndarray, change: Callable[[Image.Image, int], Image.Image]) -> np.ndarray:
    """Apply a Pillow operation image by image (``change(image, index)``)."""
    out = np.empty_like(batch)
    for index, pixels in enumerate(batch):
        image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
        changed = np.asarray(change(image, index))
        out[index] = changed[..., np.newaxis] if changed.ndim == 2 else changed
    return out


def _blur(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return _per_image(batch, lambda image, _: image.filter(ImageFilter.GaussianBlur(1.2)))


def _rotate(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    angles = rng.uniform(5.0, 12.0, len(batch)) * rng.choice([-1.0, 1.0], len(batch))

    def rotate(image: Image.Image, index: int) -> Image.Image:
        # A square turned by a shows empty corners unless it is enlarged by cos a + sin a: crop
        # the centre of the rotated image back to the original size.
        angle = float(angles[index])
        zoom = math.cos(math.radians(abs(angle))) + math.sin(math.radians(abs(angle)))
        width, height = image.size
        turned = image.rotate(angle, resample=_BILINEAR)
        crop_w, crop_h = width / zoom, height / zoom
        box = ((width - crop_w) / 2, (height - crop_h) / 2, (width + crop_w) / 2, (height + crop_h) / 2)
        return turned.resize((width, height), _BILINEAR, box=box)

    return _per_image(batch, rotate)


def _jpeg(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    def compress(image: Image.Image, _: int) -> Image.Image:
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=12)
        with Image.open(io.BytesIO(buffer.getvalue())) as decoded:
            return decoded.convert(image.mode)

    return _per_image(batch, compress)


SHIFTS = {shift.name: shift for shift in (
    Shift("low_light", "a third of the light, grainy", _low_light),
    Shift("dusk", "darker, bluer and noisier", _dusk),
    Shift("colour_cast", "tungsten white balance: redder, less blue", _colour_cast),
    Shift("blur", "defocused, Gaussian radius 1.2 px", _blur),
    Shift("fog", "low contrast, a light grey haze", _fog),
    Shift("rotate", "mounted askew, 5-12 degrees, zoomed to fill", _rotate),
    Shift("jpeg", "JPEG at quality 12", _jpeg),
)}


def get_shift(name: str) -> Shift:
    """The shift ``name`` names: one of ``SHIFTS``, your own, or several in turn.

    - ``NAME``: a built-in shift.
    - ``FILE.py:NAME`` or ``package.module:NAME``: your own camera, a ``Shift`` or a function
      ``(batch uint8 (n, h, w, c), rng) -> batch`` (any dtype holding 0-255) in that file or
      module; the function's docstring's first line is its description.
    - ``A+B``: ``A``, then ``B`` on its result (each rounded and clipped to uint8 first, as a
      camera's pipeline stores each stage): ``dusk+jpeg`` is a dim camera that compresses hard.

    Raises:
        ConfigError: ``help`` or an unknown name, a file or module that cannot be loaded, or a
            name in it that is not a shift; one line (with ``help``, the built-in shifts each with
            its description).
    """
    if name in SHIFTS:
        return SHIFTS[name]
    if name == "help":
        listed = "; ".join(f"{shift.name} ({shift.description})" for shift in SHIFTS.values())
        raise ConfigError(f"--shift takes one of: {listed}; or FILE.py:NAME (your own), "
                          "or A+B (A, then B)")
    if "+" in name:
        return _in_turn(name, [get_shift(part) for part in name.split("+")])
    if ":" in name:
        return _user_shift(name)
    raise ConfigError(f"--shift {name!r} is not a camera shift; use one of {', '.join(SHIFTS)}, "
                      "FILE.py:NAME or A+B (--shift help describes them)")


def _in_turn(name: str, parts: Sequence[Shift]) -> Shift:
    def transform(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        for part in parts:
            batch = np.clip(np.rint(part.transform(batch, rng)), 0, 255).astype(np.uint8)
        return batch

    return Shift(name, ", then ".join(part.description for part in parts), transform)


def _user_shift(spec: str) -> Shift:
    """``FILE.py:NAME`` or ``module:NAME``: a ``Shift`` or a transform function there."""
    where, _, attribute = spec.rpartition(":")
    path = Path(where).expanduser()
    if where.endswith(".py") and not path.is_file():
        raise ConfigError(f"--shift {spec!r}: no such file {path}")
    try:
        if where.endswith(".py"):
            loader = importlib.util.spec_from_file_location(f"odtd_user_shift_{path.stem}", path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as error:  # the user's code: whatever it raised, in one line
        raise ConfigError(f"--shift {spec!r}: loading {where} failed: "
                          f"{type(error).__name__}: {error}") from None
    found = getattr(module, attribute, None)
    if isinstance(found, Shift):
        return Shift(spec, found.description, found.transform)
    if not callable(found):
        raise ConfigError(f"--shift {spec!r}: {where} has no shift or function {attribute!r}")
    doc = (getattr(found, "__doc__", None) or "").strip().splitlines()
    return Shift(spec, doc[0] if doc else f"{attribute} from {where}", found)
