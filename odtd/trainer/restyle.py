"""Rehearsed images restyled to the device's camera, label-free (``training.restyle_replay``).

A device's camera differs from the server's data in light, colour, sharpness and noise. Over a
few hundred of its images, most of that shows in two statistics of the pixels, and neither needs
a label:

- the colour: the mean and the covariance of a pixel's channels (darker, bluer, foggier);
- the spatial spectrum: each channel's mean power at each spatial frequency, the images' own
  means taken out (a blur has less power at high frequencies, sensor noise adds power at all of
  them, JPEG takes the finest away).

``restyle`` gives a set of the original domain's images (the rehearsed ones) the device's
statistics: a linear map of the channels that turns the one colour distribution into the other
(whitening, then colouring), then per channel and frequency a filter where the device has less
power (``sqrt(P_device / P_rehearsed)``) and Gaussian noise of the missing power where it has
more. A blurred, darkened or noisy camera is mostly such a map; a rotation or a crop is not, and
is not matched. The labels of the rehearsed images stay theirs: a session trains on them as the
device would see them, many more labelled images of its camera than it has.

Memory: chunks of ``CHUNK`` images at a time, float32; any input size.

Python 3.6-compatible, numpy only (the worker imports it; so can the daemon).
"""

from typing import Optional, Tuple

import numpy as np

CHUNK = 64  # images per FFT: bounds the memory at any input size
MIN_IMAGES = 32  # fewer images than this on either side: their statistics are too noisy to match
MAX_GAIN = 2.0  # the most a frequency is amplified (a sharper camera than the server's data)
NOISE_MARGIN = 0.1  # less extra fine power than this share of the source's is no noise: the
# estimates of two sets of images of one camera differ by a few per cent
EIGEN_FLOOR = 1e-3  # covariance eigenvalues below this share of the largest are raised to it


class PixelStatistics(object):
    """The colour and spectrum of a set of uint8 images ``(N, H, W, C)``: what restyling matches.

    Attributes:
        mean: float64 ``(C,)``, the mean of a pixel's channels.
        covariance: float64 ``(C, C)``, their covariance over every pixel of every image.
        power: float64 ``(H, W, C)``, each channel's mean ``|FFT|^2`` per spatial frequency, each
            image's own mean taken out (0 at frequency 0).
        count: the number of images.
    """

    def __init__(self, mean: np.ndarray, covariance: np.ndarray, power: np.ndarray, count: int):
        self.mean = mean
        self.covariance = covariance
        self.power = power
        self.count = count

    @classmethod
    def of(cls, images: np.ndarray, colour: Optional[Tuple[np.ndarray, np.ndarray, np.ndarray]] = None
           ) -> "PixelStatistics":
        """Measure ``images``; ``colour`` = ``(source mean, map, target mean)`` first, if given."""
        channels = images.shape[-1]
        total = np.zeros(channels)
        outer = np.zeros((channels, channels))
        power = np.zeros(images.shape[1:])
        pixels = 0
        for start in range(0, len(images), CHUNK):
            x = _float(images[start:start + CHUNK])
            if colour is not None:
                x = _recolour(x, *colour)
            flat = x.reshape(-1, channels).astype(np.float64)
            total += flat.sum(axis=0)
            outer += flat.T.dot(flat)
            pixels += len(flat)
            power += _power(x).sum(axis=0)
        mean = total / pixels
        covariance = outer / pixels - np.outer(mean, mean)
        return cls(mean, covariance, power / len(images), len(images))


def restyle(images: np.ndarray, target: PixelStatistics, rng: np.random.RandomState) -> np.ndarray:
    """``images`` (uint8 ``(N, H, W, C)``) with ``target``'s colour and spectrum, uint8.

    The images' own statistics are measured here. Fewer than ``MIN_IMAGES`` on either side: the
    images are returned as they are (a copy).
    """
    if len(images) < MIN_IMAGES or target.count < MIN_IMAGES:
        return images.copy()
    source = PixelStatistics.of(images)
    colour = (source.mean, colour_map(source.covariance, target.covariance), target.mean)
    recoloured = PixelStatistics.of(images, colour).power
    gain, noise = spectral_match(recoloured, target.power)
    height, width = images.shape[1:3]
    noise_scale = np.sqrt(noise / (height * width)).astype(np.float32)
    out = np.empty_like(images)
    for start in range(0, len(images), CHUNK):
        x = _recolour(_float(images[start:start + CHUNK]), *colour)
        spectrum = np.fft.fft2(x, axes=(1, 2)) * gain.astype(np.float32)
        white = rng.standard_normal(x.shape).astype(np.float32)
        spectrum += np.fft.fft2(white, axes=(1, 2)) * noise_scale
        x = np.real(np.fft.ifft2(spectrum, axes=(1, 2)))
        out[start:start + CHUNK] = np.clip(np.rint(x), 0, 255).astype(np.uint8)
    return out


def spectral_match(source: np.ndarray, target: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The filter and the white noise that take power spectrum ``source`` to ``target``.

    Both ``(H, W, C)``, averaged first over rings of spatial frequency (a ring's frequencies
    have about the same power in natural images, and their average is a steadier estimate than
    any one of them). The model: ``target = gain^2 * source + noise``, ``noise`` the same at
    every frequency (sensor noise), read where the finest half of the rings are (none unless it
    is more than ``NOISE_MARGIN`` of the source's power there). ``gain`` is
    at most ``MAX_GAIN``; 1 at frequency 0 (each image keeps its own mean).

    Returns:
        ``(gain, noise)``, float64 ``(H, W, C)`` each: ``gain`` per frequency, ``noise`` the
        noise's power per frequency (0 at frequency 0).
    """
    rings = _rings(source.shape[:2])
    count = np.bincount(rings.ravel())
    gain = np.ones(source.shape)
    noise = np.zeros(source.shape)
    fine = np.arange(len(count)) >= len(count) // 2
    for channel in range(source.shape[-1]):
        src = np.bincount(rings.ravel(), source[..., channel].ravel()) / count
        tgt = np.bincount(rings.ravel(), target[..., channel].ravel()) / count
        level = float(np.median((tgt - src)[fine]))
        if level <= NOISE_MARGIN * float(np.median(src[fine])):
            level = 0.0
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(src > 0, (tgt - level) / src, 1.0)
        ring_gain = np.sqrt(np.clip(ratio, 0.0, MAX_GAIN ** 2))
        ring_gain[0] = 1.0
        gain[..., channel] = ring_gain[rings]
        noise[..., channel] = level
    noise[0, 0, :] = 0.0
    return gain, noise


def _rings(shape: Tuple[int, int]) -> np.ndarray:
    """Each frequency's ring: its distance from 0 in cycles per pixel, in steps of 1 / size."""
    fy = np.fft.fftfreq(shape[0])[:, None]
    fx = np.fft.fftfreq(shape[1])[None, :]
    return np.rint(np.sqrt(fy ** 2 + fx ** 2) * max(shape)).astype(np.int64)


def colour_map(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The linear map ``A`` of a pixel's channels with ``A source A^T = target``: colour ∘ whiten."""
    return _sqrt_psd(target).dot(np.linalg.inv(_sqrt_psd(source)))


def _sqrt_psd(covariance: np.ndarray) -> np.ndarray:
    values, vectors = np.linalg.eigh(covariance)
    values = np.maximum(values, EIGEN_FLOOR * max(float(values.max()), 1e-12))
    return (vectors * np.sqrt(values)).dot(vectors.T)


def _float(images: np.ndarray) -> np.ndarray:
    return images.astype(np.float32)


def _recolour(x: np.ndarray, source_mean: np.ndarray, mapping: np.ndarray,
              target_mean: np.ndarray) -> np.ndarray:
    channels = x.shape[-1]
    flat = (x.reshape(-1, channels) - source_mean.astype(np.float32)).dot(
        mapping.T.astype(np.float32)) + target_mean.astype(np.float32)
    return flat.reshape(x.shape)


def _power(x: np.ndarray) -> np.ndarray:
    """``|FFT|^2`` per image, channel and frequency, each image's own mean taken out."""
    centred = x - x.mean(axis=(1, 2), keepdims=True)
    spectrum = np.fft.fft2(centred, axes=(1, 2))
    return (spectrum.real ** 2 + spectrum.imag ** 2).astype(np.float64)


def restyle_rehearsed(x: np.ndarray, rehearsed: np.ndarray, device: np.ndarray, share: float,
                      seed: int) -> Tuple[np.ndarray, int]:
    """A session's training images with ``share`` of the rehearsed ones in the device's camera.

    Args:
        x: the session's training images, uint8 ``(N, H, W, C)``.
        rehearsed: one boolean per image: rehearsed from the original domain (the replay seed).
        device: the device's images whose statistics are matched (the day's and earlier days').
        share: the share of the rehearsed images restyled, 0 to 1; drawn at random (``seed``).
        seed: the draw's and the noise's seed.

    Returns:
        ``(images, restyled)``: ``x`` itself if nothing is restyled, else a copy with the chosen
        images replaced; how many were.
    """
    chosen = np.flatnonzero(rehearsed)
    rng = np.random.RandomState(seed)
    chosen = np.sort(rng.permutation(chosen)[:int(round(share * len(chosen)))])
    if len(chosen) < MIN_IMAGES or len(device) < MIN_IMAGES:
        return x, 0
    out = x.copy()
    out[chosen] = restyle(x[chosen], PixelStatistics.of(device), rng)
    return out, len(chosen)
