"""Rehearsed images restyled to the device's camera (odtd.trainer.restyle): numpy only.

The device's images are one set of images through a built-in camera shift of odtd.sim; the
rehearsed ones are another set of the same kind, unshifted. Restyling them from the device's
statistics alone must bring them near what that camera would have made of them (the shift
applied to them), which the test knows and restyling does not.
"""

import numpy as np
import pytest

from odtd.sim import datasets
from odtd.sim.shifts import SHIFTS
from odtd.trainer.restyle import (
    MIN_IMAGES,
    PixelStatistics,
    colour_map,
    restyle,
    restyle_rehearsed,
    spectral_match,
)

DEVICE, _ = datasets.synthetic(256, "server", seed=3)
REHEARSED, _ = datasets.synthetic(256, "server", seed=4)


def distance(a, b):
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def fine_detail(x):
    x = x.astype(np.float64)
    return np.abs(np.diff(x, axis=1)).mean() + np.abs(np.diff(x, axis=2)).mean()


@pytest.mark.parametrize("name", ["dusk", "colour_cast", "fog", "blur", "low_light"])
def test_restyled_images_come_near_what_the_camera_makes_of_them(name):
    shift = SHIFTS[name]
    device = shift(DEVICE, 1)
    truth = shift(REHEARSED, 2)
    restyled = restyle(REHEARSED, PixelStatistics.of(device), np.random.RandomState(0))
    assert restyled.dtype == np.uint8 and restyled.shape == REHEARSED.shape
    assert distance(restyled, truth) < 0.6 * distance(REHEARSED, truth)
    means = restyled.reshape(-1, 3).mean(axis=0)
    assert np.abs(means - truth.reshape(-1, 3).mean(axis=0)).max() < 3.0


def test_blur_is_matched_as_a_filter_and_noise_as_noise():
    blurred = restyle(REHEARSED, PixelStatistics.of(SHIFTS["blur"](DEVICE, 1)),
                      np.random.RandomState(0))
    noisy = restyle(REHEARSED, PixelStatistics.of(SHIFTS["low_light"](DEVICE, 1)),
                    np.random.RandomState(0))
    detail = {"clean": fine_detail(REHEARSED), "blur": fine_detail(SHIFTS["blur"](REHEARSED, 2)),
              "low_light": fine_detail(SHIFTS["low_light"](REHEARSED, 2))}
    assert abs(fine_detail(blurred) - detail["blur"]) < 0.25 * (detail["clean"] - detail["blur"])
    # Low light is a third of the light plus grain: the detail of a third of the contrast would
    # be a third of the clean detail; the grain puts more back, as it does in the camera.
    assert fine_detail(noisy) > 0.5 * detail["clean"] / 3
    assert abs(fine_detail(noisy) - detail["low_light"]) < 0.25 * detail["low_light"]


def test_images_of_the_same_camera_are_left_nearly_as_they_are():
    restyled = restyle(REHEARSED, PixelStatistics.of(DEVICE), np.random.RandomState(0))
    assert distance(restyled, REHEARSED) < 2.0


def test_colour_map_turns_one_covariance_into_the_other():
    rng = np.random.RandomState(5)
    a, b = rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    source, target = a.dot(a.T) + np.eye(3), b.dot(b.T) + np.eye(3)
    mapping = colour_map(source, target)
    np.testing.assert_allclose(mapping.dot(source).dot(mapping.T), target, rtol=1e-9, atol=1e-9)


def test_spectral_match_reads_a_white_noise_floor_and_a_low_pass():
    height = width = 16
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.fftfreq(width)[None, :]
    ring = np.rint(np.sqrt(fy ** 2 + fx ** 2) * height)  # power is the same around a ring
    source = (1000.0 / np.maximum(ring, 1) ** 2)[..., None]
    source[0, 0] = 0.0
    low_pass = np.exp(-(ring / 4.0) ** 2)[..., None]
    gain, noise = spectral_match(source, low_pass ** 2 * source + 700.0)  # blurred, noisy
    assert noise[0, 0, 0] == 0.0
    # Read as if the finest frequencies kept their power (a camera that only adds noise): the
    # low-pass leaves a few per cent of those 700 unexplained, the rest is read as noise.
    assert 0.9 * 700 < noise[1:, :, 0].min() == noise[1:, :, 0].max() <= 700
    assert gain[0, 0, 0] == 1.0
    np.testing.assert_allclose(gain[0, 1, 0], low_pass[0, 1, 0], rtol=0.1)
    target = low_pass ** 2 * source + 700.0
    np.testing.assert_allclose((gain ** 2 * source + noise)[1:], target[1:], rtol=0.05)


def test_too_few_images_on_either_side_are_not_restyled():
    small = PixelStatistics.of(SHIFTS["dusk"](DEVICE[:MIN_IMAGES - 1], 1))
    assert np.array_equal(restyle(REHEARSED, small, np.random.RandomState(0)), REHEARSED)
    mask = np.zeros(len(REHEARSED), bool)
    mask[:MIN_IMAGES - 1] = True
    images, count = restyle_rehearsed(REHEARSED, mask, SHIFTS["dusk"](DEVICE, 1), 1.0, 0)
    assert count == 0 and images is REHEARSED


def test_restyle_rehearsed_changes_its_share_of_the_rehearsed_images_only():
    rehearsed = np.arange(len(REHEARSED)) % 2 == 1  # 128 rehearsed, 128 of the device
    images, count = restyle_rehearsed(REHEARSED, rehearsed, SHIFTS["dusk"](DEVICE, 1), 0.5, 7)
    assert count == 64
    changed = np.array([not np.array_equal(a, b) for a, b in zip(images, REHEARSED)])
    assert changed.sum() == 64 and not changed[~rehearsed].any()
    again, _ = restyle_rehearsed(REHEARSED, rehearsed, SHIFTS["dusk"](DEVICE, 1), 0.5, 7)
    assert np.array_equal(images, again)  # the draw and the noise follow the seed


def test_any_input_size_and_one_channel():
    rng = np.random.RandomState(2)
    gray = rng.randint(0, 256, size=(40, 20, 28, 1)).astype(np.uint8)
    target = PixelStatistics.of((gray[::-1] // 2).astype(np.uint8))
    restyled = restyle(gray, target, rng)
    assert restyled.shape == gray.shape
    assert abs(restyled.mean() - gray.mean() / 2) < 3.0
