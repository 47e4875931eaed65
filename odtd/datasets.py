"""Image data sets for demos, tests and the simulated scenario (numpy and Pillow only).

- `synthetic`: a built-in, download-free 10-class image set with a server/device domain shift.
- `open_dataset`: a real labelled set (a folder or a tar archive in ``<split>/<class>/<image>``
  layout, such as the CIFAR-10 JPEG archive), read by split as file bytes or as arrays.
- `take_per_class` and `daily_draws`: deterministic, class-balanced draws of indices, such as
  "100 validation images per class" and "64 unseen images a day for 17 days".

This module runs in the daemon and CLI processes, which never import TensorFlow.
"""

from __future__ import annotations

import io
import logging
import tarfile
import zlib
from pathlib import Path, PurePosixPath
from typing import Iterable, Sequence

import numpy as np
from PIL import Image

from odtd.errors import IngestError

logger = logging.getLogger(__name__)

CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
           "dog", "frog", "horse", "ship", "truck")
DOMAINS = ("server", "device")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_LAYOUT = "<split>/<class>/<image>.jpg|jpeg|png, optionally under one top-level folder"
# Image.Resampling appeared in Pillow 9.1; older Pillow has the constant on Image itself.
_LANCZOS = getattr(Image, "Resampling", Image).LANCZOS


# --- synthetic images -------------------------------------------------------------------------

def _box(u, v, half_u, half_v):
    return np.minimum(half_u - np.abs(u), half_v - np.abs(v))


def _waves(w, cycles_per_unit=1.6):
    k = 2 * np.pi * cycles_per_unit
    return np.sin(k * w) / k


# One shape per class as a signed distance (shape units, > 0 inside); one unit is the image's
# scale in pixels, so every shape spans about 2 units before rotation.
_SHAPES = (
    lambda u, v: np.maximum(_box(u, v, 0.3, 1.0), _box(u, v, 1.0, 0.3)),     # airplane: cross
    lambda u, v: _box(u, v, 1.0, 0.5),                                        # automobile: bar
    lambda u, v: np.minimum(0.75 - v, 0.55 * (v + 1) - np.abs(u)),            # bird: triangle
    lambda u, v: np.minimum(np.hypot(u, v) - 0.55, 1 - np.hypot(u, v)),       # cat: ring
    lambda u, v: np.minimum(_box(u, v, 0.9, 0.9), _waves(u)),                 # deer: |||
    lambda u, v: 1 - np.hypot(u, v),                                          # dog: disc
    lambda u, v: np.minimum(_box(u, v, 0.9, 0.9),
                            _waves(u) * np.sin(2 * np.pi * 1.6 * v)),         # frog: checks
    lambda u, v: np.minimum(_box(u, v, 0.9, 0.9), _waves(v)),                 # horse: ===
    lambda u, v: np.minimum(_box(u, v, 0.9, 0.9), _waves((u + v) / np.sqrt(2))),  # ship: ///
    lambda u, v: np.minimum(_box(u, v, 1.0, 1.0), -_box(u, v, 0.55, 0.55)),   # truck: frame
)


def _hsv_to_rgb(hue, saturation, value):
    """Vectorised HSV (each in [0, 1], shape (n,)) to RGB floats of shape (n, 3)."""
    k = (np.array([5.0, 3.0, 1.0]) + hue[:, None] * 6) % 6
    chroma = np.clip(np.minimum(k, 4 - k), 0, 1)
    return value[:, None] - (value * saturation)[:, None] * chroma


def _blur3(images):
    """3x3 binomial blur of (n, h, w, c) floats, edges replicated."""
    padded = np.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
    rows = padded[:, :-2] + 2 * padded[:, 1:-1] + padded[:, 2:]
    return (rows[:, :, :-2] + 2 * rows[:, :, 1:-1] + rows[:, :, 2:]) / 16


def synthetic(n: int, domain: str = "server", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Generate a learnable 10-class image set with a server/device domain shift.

    Class ``c`` (named ``CLASSES[c]``) is a procedural shape: cross, bar, triangle, ring,
    vertical stripes, disc, checks, horizontal stripes, diagonal stripes, frame. Each image
    draws a position, scale, rotation (+-20 degrees), a foreground colour whose hue leans
    to the class (like CIFAR's blue ships) and a background colour with a gradient.
    ``"device"`` images are what the board's own camera would see: shapes smaller and less
    centred, a woven background texture, a 3x3 blur, a warm colour cast, lower contrast and
    twice the sensor noise. The two domains are independent draws, so a server training set
    and a device set never share images; use different seeds for disjoint sets of one domain.

    Args:
        n: number of images, >= 0.
        domain: ``"server"`` (pre-training distribution) or ``"device"``.
        seed: non-negative seed; the same (n, domain, seed) gives the same arrays.

    Returns:
        ``(x, y)``: ``x`` uint8 of shape (n, 32, 32, 3), RGB; ``y`` int64 of shape (n,),
        balanced round-robin over the 10 classes, then shuffled.

    Raises:
        ValueError: ``n`` is negative or ``domain`` is unknown.
    """
    if domain not in DOMAINS:
        raise ValueError(f"domain={domain!r} is unknown; use one of {', '.join(DOMAINS)}")
    if n < 0:
        raise ValueError(f"n={n} images is negative; use n >= 0")
    device = domain == "device"
    rng = np.random.default_rng([seed, DOMAINS.index(domain)])
    y = rng.permutation(np.arange(n) % len(CLASSES)).astype(np.int64)

    centre_px = 16 + rng.uniform(-1, 1, (n, 2)) * (7 if device else 4)
    scale_px = rng.uniform(5.5, 9.0, n) if device else rng.uniform(7.0, 11.0, n)
    angle = np.deg2rad(rng.uniform(-20, 20, n))
    fg_rgb = _hsv_to_rgb((y / len(CLASSES) + rng.normal(0, 0.05, n)) % 1,
                         rng.uniform(0.45, 0.9, n), rng.uniform(0.55, 0.95, n))
    dark = rng.random(n) < 0.6
    bg_rgb = _hsv_to_rgb(rng.random(n), rng.uniform(0.05, 0.35, n),
                         np.where(dark, rng.uniform(0.1, 0.35, n), rng.uniform(0.75, 1.0, n)))
    gradient = rng.uniform(-0.15, 0.15, (n, 2))
    texture = rng.random((n, 2, 3))  # two gratings: orientation, frequency, phase
    noise = rng.normal(0, 0.06 if device else 0.03, (n, 32, 32, 3)).astype(np.float32)

    grid_y, grid_x = np.mgrid[0:32, 0:32].astype(np.float32) + 0.5
    dx = grid_x - centre_px[:, 0, None, None]
    dy = grid_y - centre_px[:, 1, None, None]
    background = (gradient[:, 0, None, None] * (grid_x - 16) +
                  gradient[:, 1, None, None] * (grid_y - 16)) / 16
    if device:
        for grating in range(2):
            theta = texture[:, grating, 0, None, None] * np.pi
            cycles_per_px = 0.15 + 0.25 * texture[:, grating, 1, None, None]
            phase = texture[:, grating, 2, None, None] * 2 * np.pi
            along = np.cos(theta) * grid_x + np.sin(theta) * grid_y
            background = background + 0.08 * np.sin(2 * np.pi * cycles_per_px * along + phase)

    alpha = np.empty((n, 32, 32), np.float32)
    cos, sin = np.cos(angle)[:, None, None], np.sin(angle)[:, None, None]
    for label, shape in enumerate(_SHAPES):
        rows = y == label
        scale = scale_px[rows, None, None]
        u = (cos[rows] * dx[rows] + sin[rows] * dy[rows]) / scale
        v = (cos[rows] * dy[rows] - sin[rows] * dx[rows]) / scale
        # A one-pixel ramp across the edge: anti-aliased like a camera, not a hard mask.
        alpha[rows] = np.clip(0.5 + shape(u, v) * scale, 0, 1)

    alpha = alpha[..., None]
    images = ((bg_rgb[:, None, None, :] + background[..., None]) * (1 - alpha) +
              fg_rgb[:, None, None, :] * alpha).astype(np.float32)
    if device:
        images = _blur3(images)
        mean = images.mean(axis=(1, 2, 3), keepdims=True)
        images = mean + 0.7 * (images - mean)  # hazy lens, auto-exposure
        images = images * np.float32([1.12, 1.0, 0.78]) + np.float32([0.06, 0.02, -0.02])
    images = images + noise
    x = np.clip(np.rint(images * 255), 0, 255).astype(np.uint8)
    return x, y


# --- image folders and real data sets ----------------------------------------------------------

def write_image_folder(x: np.ndarray, y: np.ndarray, classes: Sequence[str], out_dir: Path,
                       fmt: str = "png", start_index: int = 0) -> list[Path]:
    """Write images as ``<out_dir>/<class>/<index>.<fmt>`` (png lossless, jpg quality 95)."""
    paths = []
    for offset, (pixels, label) in enumerate(zip(x, y)):
        folder = Path(out_dir) / classes[int(label)]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{start_index + offset:06d}.{fmt}"
        options = {"quality": 95} if fmt in ("jpg", "jpeg") else {}
        Image.fromarray(pixels).save(path, **options)
        paths.append(path)
    return paths


class ImageDataset:
    """A labelled image set in ``<split>/<class>/<image>`` layout, from a folder or a tar archive.

    A tar archive is read once, whole, into memory (name -> bytes) when the object is made:
    gzip tars are not random-access, and the CIFAR-10 JPEG archive is 19 MB.

    Attributes:
        classes: class names, in CIFAR-10 order when they are exactly CIFAR-10's, else sorted.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._members: dict[str, bytes] = {}
        self._index: dict[str, list[tuple[str, str]]] = {}
        if self.path.is_dir():
            entries = [str(p.relative_to(self.path)) for p in sorted(self.path.rglob("*"))
                       if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES]
        elif self.path.is_file():
            entries = self._read_tar()
        else:
            raise IngestError(f"{self.path}: no such dataset; expected a folder or tar of {_LAYOUT}")
        for name in entries:
            parts = PurePosixPath(name).parts
            split, label = (parts[-3], parts[-2]) if len(parts) >= 3 else (None, None)
            if split is None or len(parts) > 4:
                continue
            self._index.setdefault(split, []).append((name, label))
        if not self._index:
            raise IngestError(f"{self.path}: no images in the layout {_LAYOUT}")
        found = sorted({label for files in self._index.values() for _, label in files})
        self.classes = list(CLASSES) if sorted(CLASSES) == found else found

    def _read_tar(self) -> list[str]:
        try:
            with tarfile.open(self.path) as archive:
                for member in archive:
                    if member.isfile() and PurePosixPath(member.name).suffix.lower() in IMAGE_SUFFIXES:
                        handle = archive.extractfile(member)
                        if handle is not None:
                            self._members[member.name] = handle.read()
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            raise IngestError(f"{self.path}: not a readable tar archive ({exc})") from None
        return sorted(self._members)

    def splits(self) -> list[str]:
        """Return the split names (e.g. train, test)."""
        return sorted(self._index)

    def files(self, split: str) -> list[tuple[str, str]]:
        """Return ``(name, class name)`` pairs of a split, in a stable order."""
        if split not in self._index:
            raise IngestError(f"{self.path}: no split {split!r}; it has {', '.join(self.splits())}")
        return self._index[split]

    def read_bytes(self, name: str) -> bytes:
        """Return the original bytes of one image."""
        if self._members:
            return self._members[name]
        return (self.path / name).read_bytes()

    def load_arrays(self, split: str, indices: Iterable[int] | None = None,
                    size: tuple[int, int] = (32, 32)) -> tuple[np.ndarray, np.ndarray]:
        """Decode images of a split into ``(x uint8 (n, h, w, 3), y int64)`` (labels index ``classes``)."""
        files = self.files(split)
        chosen = range(len(files)) if indices is None else indices
        index = {name: i for i, name in enumerate(self.classes)}
        xs, ys = [], []
        for i in chosen:
            name, label = files[int(i)]
            image = Image.open(io.BytesIO(self.read_bytes(name))).convert("RGB")
            if image.size != size:
                image = image.resize(size, _LANCZOS)
            xs.append(np.asarray(image, dtype=np.uint8))
            ys.append(index[label])
        if not xs:
            return np.zeros((0, size[1], size[0], 3), np.uint8), np.zeros((0,), np.int64)
        return np.stack(xs), np.array(ys, dtype=np.int64)

    def extract(self, split: str, names: Iterable[str], out_dir: Path) -> list[Path]:
        """Write the original bytes of ``names`` to ``<out_dir>/<class>/<basename>`` (for ingest)."""
        labels = dict(self.files(split))
        paths = []
        for name in names:
            folder = Path(out_dir) / labels[name]
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / PurePosixPath(name).name
            path.write_bytes(self.read_bytes(name))
            paths.append(path)
        return paths


def open_dataset(path: Path) -> ImageDataset:
    """Open a folder or tar archive in ``<split>/<class>/<image>`` layout (e.g. CIFAR-10 JPEGs).

    Raises:
        IngestError: the path is missing or holds no images in that layout.
    """
    return ImageDataset(Path(path))


def take_per_class(y: Sequence, per_class: int, seed: int,
                   exclude: Iterable[int] = ()) -> np.ndarray:
    """Pick up to ``per_class`` indices of each label, deterministically, interleaved by class."""
    labels = np.asarray(y)
    rng = np.random.default_rng(seed)
    excluded = set(int(i) for i in exclude)
    pools = []
    for label in sorted(set(labels.tolist())):
        candidates = [int(i) for i in np.flatnonzero(labels == label) if int(i) not in excluded]
        pools.append([candidates[i] for i in rng.permutation(len(candidates))[:per_class]])
    order = [pool[k] for k in range(per_class) for pool in pools if k < len(pool)]
    return np.array(order, dtype=np.int64)


def daily_draws(y: Sequence, days: int, per_day: int, seed: int,
                exclude: Iterable[int] = ()) -> list[np.ndarray]:
    """Draw ``days`` disjoint, class-balanced sets of ``per_day`` indices ("64 unseen a day")."""
    labels = np.asarray(y)
    classes = sorted(set(labels.tolist()))
    per_class = -(-days * per_day // len(classes))
    pool = take_per_class(labels, per_class, seed, exclude)  # interleaved: balanced prefixes
    if len(pool) < days * per_day:
        raise ValueError(f"only {len(pool)} unused images for {days} days x {per_day}")
    return [pool[d * per_day:(d + 1) * per_day] for d in range(days)]
