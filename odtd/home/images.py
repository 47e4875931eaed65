"""Images: the one place an image file is decoded and fitted to the model's input.

Ingest, the validation set of ``odtctl init --validation`` and the replay seed of ``--replay``
all come through `decode_image`, so a model sees the device's camera, its validation images and
its rehearsed images prepared the same way, and the way Keras prepared its training images:

- Channels: ``convert("RGB")`` for a 3-channel model, ``convert("L")`` (ITU-R 601-2 luma) for a
  1-channel one, as ``keras.utils.load_img`` does. Alpha is dropped, not composited (a
  transparent pixel keeps its colour), as Keras and ``tf.image.decode_image`` both do. A 16-bit
  greyscale image keeps its high byte, as ``tf.image.decode_png`` does for uint8 (Pillow's own
  conversion clips everything over 255 to white).
- Size: `resize` ``stretch``, ``crop`` or ``pad`` (see ``odtd.config.ImagesConfig``), with the
  geometry of ``image_dataset_from_directory`` (``tf.image.resize``, ``smart_resize``,
  ``tf.image.resize_with_pad``). Interpolation is bilinear, as that function's default: without
  `antialias`, Pillow's affine transform samples the 4 nearest pixels exactly as
  ``tf.image.resize`` does (half-pixel centres, within 1 grey level); with it, Pillow's resize
  filter averages the whole footprint, as ``keras.utils.load_img(interpolation="bilinear")``.
  The two differ when an image shrinks: by 12 grey levels on average (43 at most) for a
  textured 640x480 image brought to 64x64.
- Animations: the first frame, as ``decode_image(expand_animations=False)``.
- EXIF orientation is not applied: neither ``load_img`` nor ``tf.image.decode_jpeg`` applies it,
  so the model was trained on pixels as stored, and a fixed camera writes one orientation.

Decoded pixels are uint8 (height, width, channels); the trainer scales them as the model's
input convention says.
"""

from __future__ import annotations

import io
import logging
import struct
import warnings
from typing import Any, Sequence, get_args

import numpy as np

from odtd.config import ResizeMode

logger = logging.getLogger(__name__)

MAX_PIXELS = 50_000_000
RESIZE_MODES = get_args(ResizeMode)
# Pillow opens 16-bit greyscale as one of these (older versions open a 16-bit PNG as "I").
_WIDE_GREY_MODES = {"I", "I;16", "I;16B", "I;16L", "I;16N"}
# What Pillow's decoders raise on a damaged file besides UnidentifiedImageError.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error)


class BadImage(Exception):
    """A single input cannot become a sample; the message is the quarantine reason."""


def check_fit(input_shape: Sequence[int], resize: str) -> tuple[int, int, int]:
    """Return (height, width, channels) of a model input, refusing what cannot be fitted.

    Raises:
        ValueError: not (height, width, 1 or 3), or ``resize`` not one of `RESIZE_MODES`.
    """
    if len(input_shape) != 3 or min(input_shape) < 1 or input_shape[2] not in (1, 3):
        raise ValueError(f"input shape {list(input_shape)}: expected (height, width, 1 or 3)")
    if resize not in RESIZE_MODES:
        raise ValueError(f"resize {resize!r}: expected one of {', '.join(RESIZE_MODES)}")
    return int(input_shape[0]), int(input_shape[1]), int(input_shape[2])


def decode_image(data: bytes, input_shape: Sequence[int], resize: str = "stretch",
                 antialias: bool = False) -> np.ndarray:
    """Decode image bytes into the model's input: uint8 (height, width, channels).

    Args:
        data: the file's bytes (JPEG, PNG, BMP, WebP, GIF, TIFF, PPM: what Pillow reads).
        input_shape: the model's (height, width, channels), channels 1 or 3.
        resize: ``stretch``, ``crop`` or ``pad`` (``odtd.config.ImagesConfig.resize``).
        antialias: Pillow's area-averaging filter instead of ``tf.image.resize``'s sampling.

    Raises:
        BadImage: empty, not an image, over 50 megapixels, corrupt or truncated, or in a colour
            mode Pillow cannot convert; the message is one line.
        ValueError: ``input_shape`` or ``resize`` is not one odtd can fit (a caller's bug).
    """
    height, width, channels = check_fit(input_shape, resize)
    # Imported here: an idle daemon has no image to decode (Pillow is 2 MB of its memory).
    from PIL import Image

    with warnings.catch_warnings(record=True) as caught:
        # Pillow warns about what it skips in a file it still decodes (a damaged TIFF tag, the
        # palette transparency that dropping alpha loses): worth a debug line, not stderr.
        warnings.simplefilter("always")
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        image = _to_channels(_open(data), channels)
    for warning in caught:
        logger.debug("decoding an image: %s", warning.message)
    fitted = _fit(image, width, height, resize, antialias)
    pixels = np.array(fitted, dtype=np.uint8)
    return pixels[:, :, np.newaxis] if pixels.ndim == 2 else pixels


def _open(data: bytes) -> Any:
    """Decode the first frame, refusing bombs before the pixels are read."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise BadImage("empty file (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > MAX_PIXELS:
            raise BadImage(f"oversized: {width}x{height} is over {MAX_PIXELS // 1_000_000} megapixels")
        image.load()
    except UnidentifiedImageError:
        raise BadImage("not an image Pillow can read") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise BadImage(f"oversized: {exc}") from None
    except _DECODE_ERRORS as exc:
        raise BadImage(f"corrupt or truncated image ({exc})") from None
    if image.width < 1 or image.height < 1:
        raise BadImage(f"empty image ({image.width}x{image.height} pixels)")
    return image


def _to_channels(image: Any, channels: int) -> Any:
    from PIL import Image

    if image.mode in _WIDE_GREY_MODES:
        wide = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
        image = Image.fromarray((wide >> 8).astype(np.uint8))
    target = "RGB" if channels == 3 else "L"
    if image.mode == target:
        return image
    try:
        return image.convert(target)
    except ValueError as exc:
        raise BadImage(f"colour mode {image.mode} is not supported ({exc})") from None
    except _DECODE_ERRORS as exc:
        raise BadImage(f"corrupt or truncated image ({exc})") from None


def _fit(image: Any, width: int, height: int, resize: str, antialias: bool) -> Any:
    """Bring an L or RGB image to (width, height) as ``resize`` says."""
    from PIL import Image

    source_w, source_h = image.size
    if (source_w, source_h) == (width, height):
        return image
    if resize == "stretch":
        return _resample(image, (0, 0, source_w, source_h), (width, height), antialias)
    if resize == "crop":
        return _resample(image, crop_box(source_w, source_h, width, height), (width, height),
                         antialias)
    (fit_w, fit_h), (left, top) = pad_geometry(source_w, source_h, width, height)
    canvas = Image.new(image.mode, (width, height), 0)
    canvas.paste(_resample(image, (0, 0, source_w, source_h), (fit_w, fit_h), antialias),
                 (left, top))
    return canvas


def crop_box(source_w: int, source_h: int, width: int, height: int) -> tuple[int, int, int, int]:
    """The largest centred box of the target's aspect ratio, as Keras's ``smart_resize``.

    Args:
        source_w: the image's width (pixels).
        source_h: its height (pixels).
        width: the target width (pixels).
        height: the target height (pixels).

    Returns:
        (left, top, right, bottom) in source pixels.
    """
    # float32 and truncation, as image_dataset_from_directory's TensorFlow graph computes it.
    crop_h = max(min(source_h, int(np.float32(source_w * height) / np.float32(width))), 1)
    crop_w = max(min(source_w, int(np.float32(source_h * width) / np.float32(height))), 1)
    top = int(np.float32(source_h - crop_h) / np.float32(2))
    left = int(np.float32(source_w - crop_w) / np.float32(2))
    return left, top, left + crop_w, top + crop_h


def pad_geometry(source_w: int, source_h: int, width: int,
                 height: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Where a padded image goes, as ``tf.image.resize_with_pad``.

    Args:
        source_w: the image's width (pixels).
        source_h: its height (pixels).
        width: the target width (pixels).
        height: the target height (pixels).

    Returns:
        ((fitted width, fitted height), (left, top) offset) in target pixels. The offset is half
        the float margin, rounded down, so an odd margin leaves the extra row below.
    """
    ratio = max(np.float32(source_w) / np.float32(width), np.float32(source_h) / np.float32(height))
    fitted_w, fitted_h = np.float32(source_w) / ratio, np.float32(source_h) / ratio
    # A sliver (1x1000 into 32x32) keeps 1 pixel, where TensorFlow would fail on 0.
    size = (max(int(np.floor(fitted_w)), 1), max(int(np.floor(fitted_h)), 1))
    left = max(int(np.floor((np.float32(width) - fitted_w) / 2)), 0)
    top = max(int(np.floor((np.float32(height) - fitted_h) / 2)), 0)
    return size, (left, top)


def _resample(image: Any, box: tuple[int, int, int, int], size: tuple[int, int],
              antialias: bool) -> Any:
    """Resize ``box`` of ``image`` to ``size`` (width, height) bilinearly."""
    from PIL import Image

    # Image.Resampling and Image.Transform arrived in Pillow 9.1; 9.0 has the bare constants.
    bilinear = getattr(Image, "Resampling", Image).BILINEAR
    if antialias:
        return image.resize(size, bilinear, box=box)
    if box != (0, 0) + image.size:
        image = image.crop(box)
    # An affine map samples each output pixel's centre between its 4 nearest source pixels:
    # tf.image.resize(antialias=False), where Image.resize widens the filter when shrinking.
    scale_x, scale_y = image.width / size[0], image.height / size[1]
    affine = getattr(Image, "Transform", Image).AFFINE
    return image.transform(size, affine, (scale_x, 0, 0, 0, scale_y, 0), resample=bilinear)
