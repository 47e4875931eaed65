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
import os
import tarfile
import zlib
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
from PIL import Image

from odtd import atomic
from odtd.errors import IngestError

logger = logging.getLogger(__name__)

CLASSES = ("airplane", "automobile", "bird", "cat", "deer",
           "dog", "frog", "horse", "ship", "truck")
DOMAINS = ("server", "device")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_LAYOUT = "<split>/<class>/<image>.jpg|jpeg|png, optionally under one top-level folder"
# Image.Resampling appeared in Pillow 9.1; older Pillow has the constant on Image itself.
_LANCZOS = getattr(Image, "Resampling", Image).LANCZOS
# Rendering in blocks keeps temporaries small: all 10,000 images at once spent most of their
# time page-faulting fresh 120 MB float arrays.
_CHUNK_IMAGES = 1024


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


def _render(y, draw, device, rng):
    """Render one block of images from their drawn parameters; the noise comes from ``rng``."""
    f32 = np.float32
    grid_y, grid_x = np.mgrid[0:32, 0:32].astype(f32) + f32(0.5)
    background = (draw["gradient"][:, 0, None, None] * (grid_x - 16) +
                  draw["gradient"][:, 1, None, None] * (grid_y - 16))
    if device:
        for grating in draw["texture"].transpose(1, 2, 0)[..., None, None]:
            theta, frequency, phase = grating[0] * np.pi, grating[1], grating[2] * 2 * np.pi
            along = np.cos(theta) * grid_x + np.sin(theta) * grid_y
            background += f32(0.05) * np.sin(2 * np.pi * (0.15 + 0.25 * frequency) * along + phase)
    alpha = np.empty((len(y), 32, 32), f32)
    for label, shape in enumerate(_SHAPES):
        rows = np.flatnonzero(y == label)
        dx = grid_x - draw["centre_px"][rows, 0, None, None]
        dy = grid_y - draw["centre_px"][rows, 1, None, None]
        cos = np.cos(draw["angle"][rows])[:, None, None]
        sin = np.sin(draw["angle"][rows])[:, None, None]
        scale = draw["scale_px"][rows, None, None]
        u, v = (cos * dx + sin * dy) / scale, (cos * dy - sin * dx) / scale
        # A one-pixel ramp across the edge: anti-aliased like a camera, not a hard mask.
        alpha[rows] = np.clip(0.5 + shape(u, v) * scale, 0, 1)
    images = draw["bg_rgb"][:, None, None, :] + background[..., None]
    images += (draw["fg_rgb"][:, None, None, :] - images) * alpha[..., None]
    if device:
        images = _blur3(images)
        mean = images.mean(axis=(1, 2, 3), keepdims=True)
        images = mean + f32(0.8) * (images - mean)  # hazy lens, auto-exposure
        images = images * f32([1.07, 1.0, 0.87]) + f32([0.036, 0.012, -0.012])  # warm lamp
    images += rng.standard_normal(images.shape, dtype=f32) * f32(0.05 if device else 0.03)
    return np.clip(np.rint(images * 255), 0, 255).astype(np.uint8)


def synthetic(n: int, domain: str = "server", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Generate a learnable 10-class image set with a server/device domain shift.

    Class ``c`` (named ``CLASSES[c]``) is a procedural shape: cross, bar, triangle, ring,
    vertical stripes, disc, checks, horizontal stripes, diagonal stripes, frame. Each image
    draws a position, scale, rotation (+-20 degrees), a foreground colour whose hue leans
    to the class (like CIFAR's blue ships) and a background colour with a gradient.
    ``"device"`` images are what the board's own camera would see: shapes smaller and less
    centred, a woven background texture, a 3x3 blur, a warm colour cast, lower contrast and
    more sensor noise. The two domains are independent draws, so a server training set
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
    # Every per-image parameter is drawn before any pixel, in this fixed order.
    draw = {
        "centre_px": 16 + rng.uniform(-1, 1, (n, 2)) * (7 if device else 4),
        "scale_px": rng.uniform(5.5, 9.0, n) if device else rng.uniform(7.0, 11.0, n),
        "angle": np.deg2rad(rng.uniform(-20, 20, n)),
        "fg_rgb": _hsv_to_rgb((y / len(CLASSES) + rng.normal(0, 0.05, n)) % 1,
                              rng.uniform(0.45, 0.9, n), rng.uniform(0.55, 0.95, n)),
        "bg_rgb": _hsv_to_rgb(rng.random(n), rng.uniform(0.05, 0.35, n),
                              np.where(rng.random(n) < 0.6, rng.uniform(0.1, 0.35, n),
                                       rng.uniform(0.75, 1.0, n))),
        "gradient": rng.uniform(-0.15, 0.15, (n, 2)) / 16,  # per pixel
        "texture": rng.random((n, 2, 3)),  # two gratings: orientation, frequency, phase
    }
    draw = {key: value.astype(np.float32) for key, value in draw.items()}
    x = np.empty((n, 32, 32, 3), np.uint8)
    for start in range(0, n, _CHUNK_IMAGES):
        block = slice(start, start + _CHUNK_IMAGES)
        x[block] = _render(y[block], {key: value[block] for key, value in draw.items()}, device, rng)
    return x, y


# --- image folders and real data sets ---------------------------------------------------------

def _write_image(path: Path, data: bytes) -> None:
    # Hidden until renamed: an inbox never ingests a half-written image.
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(path, data, durable=False)


def write_image_folder(x: np.ndarray, y: np.ndarray, classes: Sequence[str], out_dir: str | os.PathLike,
                       fmt: str = "png", start_index: int = 0) -> list[Path]:
    """Write uint8 RGB images (n, h, w, 3) as ``<out_dir>/<class>/<index:06d>.<fmt>``.

    ``y`` indexes ``classes``; ``fmt`` is png (lossless) or jpg/jpeg (quality 95); the first
    file is number ``start_index``, so batches with advancing start indices never collide.
    Each file is written under a hidden name and renamed, so an inbox never sees half a file.
    Returns the paths in the order of ``x``.

    Raises:
        ValueError: an unknown format, a wrong array shape or dtype, or a label out of range.
    """
    fmt = fmt.lower()
    if fmt not in ("png", "jpg", "jpeg"):
        raise ValueError(f"fmt={fmt!r} is not supported; use png, jpg or jpeg")
    x, y = np.asarray(x), np.asarray(y)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[-1] != 3 or y.shape != x.shape[:1]:
        raise ValueError(f"need uint8 images (n, h, w, 3) and n labels; got {x.dtype} {x.shape} "
                         f"and labels of shape {y.shape}")
    if len(y) and not 0 <= y.min() <= y.max() < len(classes):
        raise ValueError(f"labels {y.min()}..{y.max()} do not index the {len(classes)} classes")
    options = {"format": "PNG"} if fmt == "png" else {"format": "JPEG", "quality": 95}
    paths = []
    for offset, (pixels, label) in enumerate(zip(x, y)):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, **options)
        path = Path(out_dir) / classes[int(label)] / f"{start_index + offset:06d}.{fmt}"
        _write_image(path, buffer.getvalue())
        paths.append(path)
    return paths


class ImageDataset:
    """A labelled image set in ``<split>/<class>/<image>`` layout; `open_dataset` makes one.

    An image's name is its POSIX path below the layout's root (``train/cat/0001.jpg``), without
    any top-level folder that held the splits. Labels are indices into ``classes``.

    Attributes:
        path: the folder or archive it was read from.
        classes: the class folder names found, sorted (CIFAR-10's are already in CIFAR order).
    """

    def __init__(self, path: Path, names: Iterable[str], read: Callable[[str], bytes]) -> None:
        """Index ``split/class/file`` names; ``read(name)`` returns an image's bytes."""
        self.path = Path(path)
        self._read = read
        by_split: dict[str, list[tuple[str, str]]] = {}
        for name in sorted(names):
            split, label, _ = name.split("/")
            by_split.setdefault(split, []).append((name, label))
        found = sorted({label for files in by_split.values() for _, label in files})
        self.classes = list(CLASSES) if found == sorted(CLASSES) else found
        number = {label: index for index, label in enumerate(self.classes)}
        self._splits = {split: {name: number[label] for name, label in files}
                        for split, files in sorted(by_split.items())}

    def _split(self, split: str) -> dict[str, int]:
        if split not in self._splits:
            raise IngestError(f"{self.path}: no split {split!r}; it has {', '.join(self._splits)}")
        return self._splits[split]

    def splits(self) -> list[str]:
        """Return the split names, sorted (``["test", "train"]`` for CIFAR-10)."""
        return list(self._splits)

    def files(self, split: str) -> list[tuple[str, int]]:
        """Return a split's ``(name, label)`` pairs, sorted by name (IngestError: no such split)."""
        return list(self._split(split).items())

    def read_bytes(self, name: str) -> bytes:
        """Return an image's original bytes (KeyError: unknown name; IngestError: unreadable)."""
        if not any(name in files for files in self._splits.values()):
            raise KeyError(f"{self.path}: no image named {name!r}")
        try:
            return self._read(name)
        except OSError as err:
            raise IngestError(f"{self.path}: cannot read {name}: {err}") from err

    def load_arrays(self, split: str, indices: Iterable[int] | None = None,
                    size: tuple[int, int] = (32, 32)) -> tuple[np.ndarray, np.ndarray]:
        """Decode images as ``(x uint8 (n, height, width, 3), y int64 (n,))``.

        ``indices`` are positions in `files` (``None``: the whole split, in order); ``size`` is
        (width, height) in pixels. Pillow decodes, converts to RGB, and resizes (Lanczos) only
        images of another size.

        Raises:
            IngestError: no such split, or an image cannot be decoded (named in the message).
        """
        files = self.files(split)
        if indices is not None:
            files = [files[int(index)] for index in np.asarray(indices).ravel()]
        width, height = size
        x = np.empty((len(files), height, width, 3), np.uint8)
        for row, (name, _) in enumerate(files):
            try:
                with Image.open(io.BytesIO(self.read_bytes(name))) as image:
                    rgb = image.convert("RGB")
            except (OSError, ValueError, Image.DecompressionBombError) as err:
                raise IngestError(f"{self.path}: cannot decode {name} ({err}); "
                                  "the file is damaged or not an image") from err
            x[row] = np.asarray(rgb if rgb.size == (width, height)
                                else rgb.resize((width, height), _LANCZOS))
        return x, np.array([label for _, label in files], dtype=np.int64)

    def extract(self, split: str, names: Iterable[str], out_dir: str | os.PathLike) -> list[Path]:
        """Write images' original bytes to ``<out_dir>/<class>/<basename>`` for ingest; return the paths.

        Each file is written under a hidden name and renamed (KeyError: a name not in the split).
        """
        labels = self._split(split)
        paths = []
        for name in names:
            if name not in labels:
                raise KeyError(f"{self.path}: split {split!r} has no image {name!r}")
            path = Path(out_dir) / self.classes[labels[name]] / name.rsplit("/", 1)[-1]
            _write_image(path, self.read_bytes(name))
            paths.append(path)
        return paths


def _image_parts(name: str) -> tuple[str, ...]:
    """Split a relative POSIX name of an image; ``()`` for others, hidden files and ``..``."""
    parts = tuple(part for part in name.split("/") if part not in ("", "."))
    if (name.startswith("/") or not parts or any(part.startswith(".") for part in parts)
            or os.path.splitext(parts[-1])[1].lower() not in IMAGE_SUFFIXES):
        return ()
    return parts


def _layout(path: Path, candidates: Iterable[str]) -> tuple[str, list[str]]:
    """Find ``<split>/<class>/<image>`` names, directly or under one top folder: (prefix, names)."""
    parts = [p for p in map(_image_parts, candidates) if p]
    direct = ["/".join(p) for p in parts if len(p) == 3]
    if direct:
        return "", direct
    tops = {p[0] for p in parts if len(p) == 4}
    if len(tops) == 1:
        top = tops.pop()
        return f"{top}/", ["/".join(p[1:]) for p in parts if len(p) == 4]
    raise IngestError(f"{path}: no images in the layout {_LAYOUT} (found {len(parts)} images, "
                      f"{len(tops)} top-level folders); point at the folder that holds the splits")


def _read_tar(path: Path) -> dict[str, bytes]:
    blobs = {}
    try:
        with tarfile.open(path, "r:*") as archive:
            for member in archive:
                parts = _image_parts(member.name)  # also drops a leading "./"
                handle = archive.extractfile(member) if parts and member.isfile() else None
                if handle is not None:
                    blobs["/".join(parts)] = handle.read()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as err:
        raise IngestError(f"{path}: not a readable tar archive ({err}); expected a folder or a "
                          f".tar/.tar.gz of {_LAYOUT}") from err
    return blobs


def open_dataset(path: str | os.PathLike) -> ImageDataset:
    """Open a labelled image set: a folder, or a tar archive (plain, gzip, bzip2 or xz).

    Either holds ``<split>/<class>/<image>.jpg|jpeg|png``, optionally under one top-level
    folder; hidden files (``._x.jpg``) and other files are ignored. A folder is read file by
    file, on demand. A tar archive is read once, whole, into memory (a dict name -> bytes) here:
    a gzip stream has no random access, and the CIFAR-10 JPEG archive is 19 MB (55 MB of JPEGs
    in memory, about 2 s to read).

    Raises:
        IngestError: the path is missing, is neither a folder nor a readable tar archive, or
            holds no images in that layout; the message names the path and the layout.
    """
    path = Path(path)
    if path.is_dir():
        found = [item.relative_to(path).as_posix() for pattern in ("*/*/*", "*/*/*/*")
                 for item in path.glob(pattern) if item.suffix.lower() in IMAGE_SUFFIXES and item.is_file()]
        prefix, names = _layout(path, found)
        root = path / prefix
        dataset = ImageDataset(path, names, lambda name: (root / name).read_bytes())
    elif path.is_file():
        blobs = _read_tar(path)
        prefix, names = _layout(path, blobs)
        blobs = {name: blobs[prefix + name] for name in names}
        dataset = ImageDataset(path, names, blobs.__getitem__)
    else:
        raise IngestError(f"{path}: no such dataset; expected a folder or a tar archive of {_LAYOUT}")
    logger.debug("%s: %d classes, splits %s", path, len(dataset.classes), dataset.splits())
    return dataset


# --- draws ------------------------------------------------------------------------------------

def take_per_class(y: Sequence, per_class: int, seed: int, exclude: Iterable[int] = ()) -> np.ndarray:
    """Draw up to ``per_class`` int64 indices into ``y`` of each label, deterministically.

    ``y`` holds integer labels or class names; indices in ``exclude`` are never drawn. The
    result is interleaved by class (one index of every class, then the next round), so any
    prefix is as balanced as it can be: ``take_per_class(y, 30, s)[:250]`` has 25 of each of 10
    classes. A class with fewer than ``per_class`` images left gives all it has.
    """
    if per_class < 0:
        raise ValueError(f"per_class={per_class} is negative; use >= 0")
    labels = np.asarray(y)
    rng = np.random.default_rng(seed)
    available = np.ones(len(labels), dtype=bool)
    available[np.asarray(exclude if isinstance(exclude, np.ndarray) else list(exclude), np.int64)] = False
    pools = [rng.permutation(np.flatnonzero((labels == label) & available))[:per_class]
             for label in np.unique(labels)]
    if not pools:
        return np.zeros(0, np.int64)
    rounds = np.concatenate([np.arange(len(pool)) for pool in pools])
    classes = np.concatenate([np.full(len(pool), number) for number, pool in enumerate(pools)])
    return np.concatenate(pools)[np.lexsort((classes, rounds))].astype(np.int64)


def daily_draws(y: Sequence, days: int, per_day: int, seed: int,
                exclude: Iterable[int] = ()) -> list[np.ndarray]:
    """Draw ``days`` disjoint int64 index arrays of ``per_day`` into ``y``: "64 new a day".

    Labels and ``exclude`` as in `take_per_class`. Balanced as far as the data allow: each day
    has every class ``per_day // classes`` or one more times, the extra images rotating over
    the classes from day to day; a class that runs out leaves its share to the others. Day
    ``d``'s draw does not depend on ``days``: a run extended from 7 to 17 days keeps its first 7.

    Raises:
        ValueError: a negative count, or fewer than ``days * per_day`` images left.
    """
    if days < 0 or per_day < 0:
        raise ValueError(f"days={days}, per_day={per_day}: both must be >= 0")
    total = days * per_day
    pool = take_per_class(y, total, seed, exclude)[:total]
    if len(pool) < total:
        raise ValueError(f"{days} days x {per_day} images need {total} images, but only {len(pool)} "
                         "are left after the excluded ones; draw fewer days or fewer a day")
    return [pool[day * per_day:(day + 1) * per_day] for day in range(days)]
