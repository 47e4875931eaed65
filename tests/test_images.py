"""odtd.home.images on real image files written with Pillow: modes, sizes, geometry, bad files."""

import io

import numpy as np
import pytest
from PIL import Image

from odtd.config import Config, ImagesConfig, load_config
from odtd.errors import ConfigError
from odtd.home.images import BadImage, decode_image, pad_geometry

COLOUR = (200, 100, 50)
GREY = 124  # Pillow's convert("L") of COLOUR: (200 * 299 + 100 * 587 + 50 * 114) / 1000
RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def _encode(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def _animated(fmt: str, **options) -> bytes:
    frames = [Image.new("RGB", (40, 30), COLOUR), Image.new("RGB", (40, 30), BLUE)]
    return _encode(frames[0], fmt, save_all=True, append_images=frames[1:], **options)


def _palette(fmt: str, **options) -> bytes:
    image = Image.new("P", (40, 30), 0)
    image.putpalette(list(COLOUR) + list(BLUE) + [0, 0, 0] * 254)
    return _encode(image, fmt, **options)


def _sixteen_bit() -> bytes:
    return _encode(Image.fromarray(np.full((30, 40), 0x7CFF, dtype=np.uint16)), "PNG")


# name -> (file bytes, expected RGB of every pixel, JPEG-like tolerance in grey levels)
SOURCES = {
    "RGB JPEG": (lambda: _encode(Image.new("RGB", (40, 30), COLOUR), "JPEG", quality=95), COLOUR, 3),
    "RGBA PNG, fully transparent": (lambda: _encode(Image.new("RGBA", (40, 30), COLOUR + (0,)), "PNG"),
                                    COLOUR, 0),
    "L PNG": (lambda: _encode(Image.new("L", (40, 30), GREY), "PNG"), (GREY,) * 3, 0),
    "LA PNG": (lambda: _encode(Image.new("LA", (40, 30), (GREY, 7)), "PNG"), (GREY,) * 3, 0),
    # The first palette entry fully transparent, the second half: PNG's tRNS as bytes.
    "P PNG, transparency as bytes": (lambda: _palette("PNG", transparency=b"\x00\x80"), COLOUR, 0),
    "P GIF, transparent index": (lambda: _palette("GIF", transparency=0), COLOUR, 0),
    "I;16 PNG": (_sixteen_bit, (GREY,) * 3, 0),
    "CMYK JPEG": (lambda: _encode(Image.new("RGB", (40, 30), COLOUR).convert("CMYK"), "JPEG",
                                  quality=95), COLOUR, 3),
    "1-bit BMP": (lambda: _encode(Image.new("1", (40, 30), 1), "BMP"), (255, 255, 255), 0),
    "RGB BMP": (lambda: _encode(Image.new("RGB", (40, 30), COLOUR), "BMP"), COLOUR, 0),
    "RGBA WebP": (lambda: _encode(Image.new("RGBA", (40, 30), COLOUR + (90,)), "WEBP", lossless=True),
                  COLOUR, 0),
    "animated GIF": (lambda: _animated("GIF"), COLOUR, 0),
    "animated WebP": (lambda: _animated("WEBP", lossless=True), COLOUR, 0),
    "RGB TIFF": (lambda: _encode(Image.new("RGB", (40, 30), COLOUR), "TIFF"), COLOUR, 0),
    "RGB PPM": (lambda: _encode(Image.new("RGB", (40, 30), COLOUR), "PPM"), COLOUR, 0),
}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_every_mode_into_a_three_and_a_one_channel_model(name):
    make, rgb, tolerance = SOURCES[name]
    data = make()
    colour = decode_image(data, (16, 24, 3))
    grey = decode_image(data, (16, 24, 1))
    assert colour.shape == (16, 24, 3) and colour.dtype == np.uint8
    assert grey.shape == (16, 24, 1) and grey.dtype == np.uint8
    assert np.abs(colour.astype(int) - rgb).max() <= tolerance
    expected_grey = round((rgb[0] * 299 + rgb[1] * 587 + rgb[2] * 114) / 1000)
    assert np.abs(grey.astype(int) - expected_grey).max() <= tolerance + 1


def test_sixteen_bit_keeps_the_high_byte_not_pillows_clip():
    ramp = (np.arange(30 * 40, dtype=np.uint32).reshape(30, 40) * 53).astype(np.uint16)
    pixels = decode_image(_encode(Image.fromarray(ramp), "PNG"), (30, 40, 1))
    assert np.array_equal(pixels[:, :, 0], (ramp >> 8).astype(np.uint8))


def test_exif_orientation_is_not_applied():
    image = Image.new("RGB", (40, 20), RED)
    image.paste(BLUE, (20, 0, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    pixels = decode_image(_encode(image, "JPEG", quality=95, exif=exif), (20, 40, 3))
    assert pixels.shape == (20, 40, 3)  # as stored: wide, red left, blue right
    assert pixels[10, 5, 0] > 240 and pixels[10, 34, 2] > 240


def _photo(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (max(height // 8, 2), max(width // 8, 2), 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((width, height), getattr(Image, "Resampling", Image).BICUBIC)
    return _encode(image, "PNG")


@pytest.mark.parametrize("resize", ["stretch", "crop", "pad"])
@pytest.mark.parametrize("source, input_shape", [
    ((640, 480), (64, 64, 3)),   # larger, 4:3 into square
    ((20, 50), (32, 32, 3)),     # smaller, tall
    ((8, 8), (32, 32, 1)),       # smaller, same aspect
    ((97, 33), (37, 23, 1)),     # wide into tall, odd sizes
    ((1, 400), (32, 32, 3)),     # a sliver
])
def test_any_size_into_any_input(source, input_shape, resize):
    pixels = decode_image(_photo(*source), input_shape, resize)
    assert pixels.shape == input_shape and pixels.dtype == np.uint8
    assert pixels.max() > 0  # an image, not just padding


def _stripes() -> bytes:
    """200x100: a red quarter, a green half, a blue quarter, left to right."""
    image = Image.new("RGB", (200, 100), GREEN)
    image.paste(RED, (0, 0, 50, 100))
    image.paste(BLUE, (150, 0, 200, 100))
    return _encode(image, "PNG")


def _tall_halves() -> bytes:
    """50x100: red above, blue below."""
    image = Image.new("RGB", (50, 100), RED)
    image.paste(BLUE, (0, 50, 50, 100))
    return _encode(image, "PNG")


def _is(region: np.ndarray, colour) -> bool:
    return bool(np.all(region == np.array(colour, dtype=np.uint8)))


@pytest.mark.parametrize("antialias", [False, True])
def test_stretch_crop_and_pad_of_a_wide_image(antialias):
    data = _stripes()
    stretched = decode_image(data, (32, 32, 3), "stretch", antialias)
    assert _is(stretched[:, :6], RED) and _is(stretched[:, 10:22], GREEN)
    assert _is(stretched[:, 26:], BLUE)
    # The largest centred square, x 50..150, is all green; Pillow's filter (antialias), as in
    # load_img(keep_aspect_ratio=True), reaches a pixel or two past the box's edges.
    cropped = decode_image(data, (32, 32, 3), "crop", antialias)
    assert _is(cropped[:, 1:31] if antialias else cropped, GREEN)
    padded = decode_image(data, (32, 32, 3), "pad", antialias)
    # Fitted to 32x16, centred: 8 rows of zeros above and below.
    assert _is(padded[:8], (0, 0, 0)) and _is(padded[24:], (0, 0, 0))
    assert _is(padded[8:24, :6], RED) and _is(padded[8:24, 10:22], GREEN)
    assert _is(padded[8:24, 26:], BLUE)


@pytest.mark.parametrize("antialias", [False, True])
def test_stretch_crop_and_pad_of_a_tall_image(antialias):
    data = _tall_halves()
    for resize in ("stretch", "crop"):
        # crop keeps rows 25..75: still red above blue, each half of the output.
        pixels = decode_image(data, (32, 32, 3), resize, antialias)
        assert _is(pixels[:14], RED) and _is(pixels[18:], BLUE)
    padded = decode_image(data, (32, 32, 3), "pad", antialias)
    assert _is(padded[:, :8], (0, 0, 0)) and _is(padded[:, 24:], (0, 0, 0))
    assert _is(padded[:14, 8:24], RED) and _is(padded[18:, 8:24], BLUE)


def test_pad_puts_an_odd_margin_below_as_tensorflow_does():
    # 40x12 into 16 wide: fitted 16x4.8 -> 4 rows; margin (8 - 4.8) / 2 = 1.6 -> 1 row above.
    assert pad_geometry(40, 12, 16, 8) == ((16, 4), (0, 1))
    padded = decode_image(_encode(Image.new("L", (40, 12), 255), "PNG"), (8, 16, 1), "pad")
    assert padded[:, :, 0].min(axis=1).tolist() == [0, 255, 255, 255, 255, 0, 0, 0]


def _jpeg(size: int = 64) -> bytes:
    rng = np.random.default_rng(1)
    return _encode(Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)), "JPEG")


@pytest.mark.parametrize("make, reason", [
    (lambda: b"", r"^empty file \(0 bytes\)$"),
    (lambda: b"just some notes\n", r"^not an image Pillow can read$"),
    (lambda: _jpeg()[:300], r"^corrupt or truncated image \("),
    (lambda: _photo(64, 48)[:-200], r"^corrupt or truncated image \("),
    (lambda: _photo(64, 48)[:120] + b"\xff" * 40 + _photo(64, 48)[160:], r"^corrupt or truncated image \("),
    (lambda: _encode(Image.new("1", (8000, 7000)), "PNG"), r"^oversized: 8000x7000 is over 50 megapixels$"),
])
def test_bad_files_give_a_one_line_reason(make, reason):
    with pytest.raises(BadImage, match=reason) as caught:
        decode_image(make(), (32, 32, 3))
    assert "\n" not in str(caught.value)


def test_a_shape_or_mode_odtd_cannot_fit_is_a_callers_error():
    with pytest.raises(ValueError, match=r"expected \(height, width, 1 or 3\)"):
        decode_image(_jpeg(), (32, 32))
    with pytest.raises(ValueError, match=r"expected \(height, width, 1 or 3\)"):
        decode_image(_jpeg(), (32, 32, 4))
    with pytest.raises(ValueError, match="resize 'fill': expected one of stretch, crop, pad"):
        decode_image(_jpeg(), (32, 32, 3), "fill")


def test_images_config_defaults_and_a_bad_value(tmp_path):
    assert Config().images == ImagesConfig(resize="stretch", antialias=False)
    path = tmp_path / "odtd.yaml"
    path.write_text("images:\n  resize: pad\n  antialias: true\n")
    assert load_config(path).images == ImagesConfig(resize="pad", antialias=True)
    path.write_text("images:\n  resize: fill\n")
    with pytest.raises(ConfigError, match=r"odtd.yaml: images.resize='fill': Input should be 'stretch', "
                                          r"'crop' or 'pad'"):
        load_config(path)
    path.write_text("images:\n  rezise: pad\n")
    with pytest.raises(ConfigError, match=r"unknown key 'images.rezise'"):
        load_config(path)


def test_same_pixels_as_keras(tmp_path):
    """stretch, crop and pad as image_dataset_from_directory; antialias as keras.utils.load_img."""
    keras = pytest.importorskip("keras")
    if int(keras.__version__.split(".")[0]) < 3:
        pytest.skip("pad_to_aspect_ratio is Keras 3's")
    sources = {"a.png": (640, 480), "b.png": (20, 50), "c.png": (97, 33), "d.png": (64, 64)}
    for name, (width, height) in sources.items():
        (tmp_path / name).write_bytes(_photo(width, height, seed=width))
    Image.open(tmp_path / "c.png").convert("RGBA").save(tmp_path / "c.png")
    for shape in [(64, 64, 3), (37, 23, 3), (24, 40, 1)]:
        color_mode = "rgb" if shape[2] == 3 else "grayscale"
        for resize, flags in [("stretch", {}), ("crop", {"crop_to_aspect_ratio": True}),
                              ("pad", {"pad_to_aspect_ratio": True})]:
            dataset = keras.utils.image_dataset_from_directory(
                tmp_path, labels=None, image_size=shape[:2], color_mode=color_mode,
                shuffle=False, batch_size=None, verbose=False, **flags)
            theirs = [np.asarray(x) for x in dataset]
            ours = [decode_image((tmp_path / name).read_bytes(), shape, resize) for name in sorted(sources)]
            assert len(theirs) == len(ours) == 4
            # TensorFlow's floats against our uint8, and its own RGB-to-grey weights.
            tolerance = 1.01 if shape[2] == 3 else 2.01
            for mine, reference in zip(ours, theirs):
                assert np.abs(mine.astype(np.float32) - reference).max() <= tolerance, (shape, resize)
        for resize, keep_aspect_ratio in [("stretch", False), ("crop", True)]:
            for name in sorted(sources):
                reference = keras.utils.img_to_array(keras.utils.load_img(
                    tmp_path / name, color_mode=color_mode, target_size=shape[:2],
                    interpolation="bilinear", keep_aspect_ratio=keep_aspect_ratio))
                mine = decode_image((tmp_path / name).read_bytes(), shape, resize, antialias=True)
                assert np.abs(mine.astype(np.float32) - reference).max() <= 1, (name, shape, resize)
