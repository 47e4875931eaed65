"""The camera shifts of odtd.sim.shifts: each deterministic, shape-keeping, and changing images the
way its name says (numpy and Pillow only; no TensorFlow worker)."""

import numpy as np
import pytest
from conftest import odtctl
from PIL import Image

from odtd.errors import ConfigError
from odtd.sim import datasets
from odtd.sim.shifts import SHIFTS, get_shift
from odtd.sim.simulate import DataSource, SimulationOptions

IMAGES, _ = datasets.synthetic(40, "server", seed=5)
RANDOM = {"low_light", "dusk", "rotate"}  # the shifts that draw from the seed


def gradient(x):
    """Mean absolute difference between neighbouring pixels: the images' fine detail."""
    x = x.astype(np.float64)
    return np.abs(np.diff(x, axis=1)).mean() + np.abs(np.diff(x, axis=2)).mean()


def blockiness(x):
    """Jumps across JPEG's 8-pixel block boundaries over jumps inside the blocks (columns)."""
    jumps = np.abs(np.diff(x.astype(np.float64), axis=2))  # jumps[:, :, j] is between j and j+1
    across = np.zeros(jumps.shape[2], bool)
    across[7::8] = True
    return jumps[:, :, across].mean() / jumps[:, :, ~across].mean()


def channel_means(x):
    return x.reshape(-1, 3).astype(np.float64).mean(axis=0)


def bar_rows(x):
    """How many rows hold some of a white horizontal bar on black."""
    return int(np.sum(x[..., 0].max(axis=1) > 64))


def check_low_light(x, out):
    assert out.mean() < 0.45 * x.mean()
    # Noise, not only a gain: the same image darkened without noise differs from it.
    assert np.abs(out.astype(float) - 0.35 * x).mean() > 2


def check_dusk(x, out):
    before, after = channel_means(x), channel_means(out)
    assert out.mean() < 0.7 * x.mean()
    assert after[2] / after[0] > 1.3 * before[2] / before[0]  # bluer
    assert np.abs(out.astype(float) - x * np.array([0.42, 0.5, 0.65])).mean() > 2  # noisier


def check_colour_cast(x, out):
    before, after = channel_means(x), channel_means(out)
    assert after[0] - after[2] > before[0] - before[2] + 20  # redder, less blue


def check_blur(x, out):
    assert gradient(out) < 0.7 * gradient(x)
    assert abs(out.mean() - x.mean()) < 2


def check_fog(x, out):
    assert out.std(axis=(1, 2, 3)).mean() < 0.5 * x.std(axis=(1, 2, 3)).mean()
    assert abs(out.mean() - 190) < abs(x.mean() - 190)


def check_rotate(x, out):
    bar = np.zeros((32, 32, 3), np.uint8)
    bar[15:17, 4:28] = 255
    assert bar_rows(bar) == 2
    assert all(bar_rows(turned) >= 4 for turned in SHIFTS["rotate"](np.stack([bar] * 8), seed=1))
    assert abs(out.mean() - x.mean()) < 0.05 * x.mean()


def check_jpeg(x, out):
    assert blockiness(out) > 1.2 * blockiness(x)
    assert np.abs(out.astype(float) - x).mean() > 2


CHECKS = {"low_light": check_low_light, "dusk": check_dusk, "colour_cast": check_colour_cast,
          "blur": check_blur, "fog": check_fog, "rotate": check_rotate, "jpeg": check_jpeg}


def test_the_suite_is_five_or_more_and_each_is_checked():
    assert len(SHIFTS) >= 5
    assert set(CHECKS) == set(SHIFTS)


@pytest.mark.parametrize("name", sorted(SHIFTS))
def test_a_shift_changes_images_the_way_its_name_says(name):
    out = SHIFTS[name](IMAGES, seed=3)
    assert out.dtype == np.uint8 and out.shape == IMAGES.shape
    CHECKS[name](IMAGES, out)


@pytest.mark.parametrize("name", sorted(SHIFTS))
def test_a_shift_is_deterministic_per_seed_and_leaves_its_input_alone(name):
    original = IMAGES.copy()
    first = SHIFTS[name](IMAGES, seed=[7, 1])
    assert np.array_equal(first, SHIFTS[name](IMAGES, seed=[7, 1]))
    assert np.array_equal(IMAGES, original)
    other = SHIFTS[name](IMAGES, seed=[7, 2])
    assert np.array_equal(first, other) == (name not in RANDOM)


@pytest.mark.parametrize("name", sorted(SHIFTS))
def test_a_shift_keeps_shape_and_dtype_of_one_image_and_of_grey_images(name):
    shift = SHIFTS[name]
    one = shift(IMAGES[0], seed=0)
    assert one.dtype == np.uint8 and one.shape == (32, 32, 3)
    grey = IMAGES[:4, :24, :, :1]  # 1 channel, not square
    out = shift(grey, seed=0)
    assert out.dtype == np.uint8 and out.shape == (4, 24, 32, 1)
    assert shift(IMAGES[:0], seed=0).shape == (0, 32, 32, 3)


def test_a_batch_is_shifted_in_blocks_without_changing_the_result():
    from odtd.sim import shifts

    many = np.concatenate([IMAGES] * 30)  # 1,200 images: two blocks of the noise generator
    assert len(many) > shifts._CHUNK_IMAGES
    out = SHIFTS["dusk"](many, seed=0)
    assert out.shape == many.shape and not np.array_equal(out[:40], out[40:80])


def test_a_shift_refuses_what_is_not_uint8_images():
    with pytest.raises(ValueError, match=r"shift blur: expected uint8 images .* got float64"):
        SHIFTS["blur"](IMAGES.astype(float))
    with pytest.raises(ValueError, match=r"got uint8 \(32, 32, 4\)"):
        SHIFTS["fog"](np.zeros((32, 32, 4), np.uint8))


def test_help_and_an_unknown_name_list_the_shifts_in_one_line():
    assert get_shift("fog") is SHIFTS["fog"]
    with pytest.raises(ConfigError) as unknown:
        get_shift("sepia")
    message = str(unknown.value)
    assert message.startswith("--shift 'sepia' is not a camera shift; use one of low_light, dusk,")
    assert "\n" not in message and all(name in message for name in SHIFTS)
    with pytest.raises(ConfigError) as described:
        get_shift("help")
    message = str(described.value)
    assert "\n" not in message and "dusk (darker, bluer and noisier)" in message
    assert all(f"{shift.name} ({shift.description})" in message for shift in SHIFTS.values())


CAMERA = """
import numpy as np
from odtd.sim.shifts import Shift


def vignette(batch, rng):
    \"\"\"Dark corners and a little noise.

    More words.
    \"\"\"
    h, w = batch.shape[1:3]
    y, x = np.mgrid[:h, :w]
    fall = 1 - 0.6 * (((y - h / 2) / h) ** 2 + ((x - w / 2) / w) ** 2) * 2
    return batch * fall[None, :, :, None] + rng.normal(0, 3, batch.shape)


PINK = Shift("pink", "a pink filter", lambda batch, rng: batch * np.array([1.0, 0.8, 0.9]))
NOT_A_SHIFT = 3
"""


def test_shifts_in_turn_apply_each_to_the_stored_result_of_the_last():
    both = get_shift("fog+jpeg")
    assert both.name == "fog+jpeg"
    assert both.description == "low contrast, a light grey haze, then JPEG at quality 12"
    assert np.array_equal(both(IMAGES, seed=2), SHIFTS["jpeg"](SHIFTS["fog"](IMAGES)))
    # Each stage is stored as uint8 (clipped), so the order matters.
    assert not np.array_equal(get_shift("colour_cast+fog")(IMAGES), get_shift("fog+colour_cast")(IMAGES))
    with pytest.raises(ConfigError, match=r"--shift 'sepia' is not a camera shift"):
        get_shift("fog+sepia")


def test_a_camera_of_your_own_from_a_python_file_or_module(tmp_path, monkeypatch):
    path = tmp_path / "camera.py"
    path.write_text(CAMERA)
    mine = get_shift(f"{path}:vignette")
    assert mine.description == "Dark corners and a little noise."
    out = mine(IMAGES, seed=[1, 2])
    assert out.dtype == np.uint8 and out.shape == IMAGES.shape
    assert np.array_equal(out, mine(IMAGES, seed=[1, 2]))
    assert not np.array_equal(out, mine(IMAGES, seed=[1, 3]))
    assert out[:, :4, :4].mean() < 0.8 * IMAGES[:, :4, :4].mean()  # the corners darkened
    assert abs(out[:, 14:18, 14:18].mean() - IMAGES[:, 14:18, 14:18].mean()) < 5  # not the centre
    pink = get_shift(f"{path}:PINK")
    assert pink.name == f"{path}:PINK" and pink.description == "a pink filter"
    assert np.array_equal(get_shift(f"fog+{path}:PINK")(IMAGES), pink(SHIFTS["fog"](IMAGES)))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert np.array_equal(get_shift("camera:PINK")(IMAGES), pink(IMAGES))
    for spec, message in ((f"{path}:NOT_A_SHIFT", "has no shift or function 'NOT_A_SHIFT'"),
                          (f"{path}:missing", "has no shift or function 'missing'"),
                          (f"{tmp_path}/nowhere.py:x", "no such file"),
                          ("no_such_module_here:x", "loading no_such_module_here failed: "
                                                    "ModuleNotFoundError")):
        with pytest.raises(ConfigError, match=message) as refused:
            get_shift(spec)
        assert "\n" not in str(refused.value)
    broken = tmp_path / "broken.py"
    broken.write_text("1 / 0\n")
    with pytest.raises(ConfigError, match=r"loading .*broken.py failed: ZeroDivisionError"):
        get_shift(f"{broken}:x")


# --- odtctl simulate --shift ------------------------------------------------------------------

def read_folder(root):
    """Images written by write_image_folder, in the order written (files are numbered)."""
    paths = sorted(root.glob("*/*.png"), key=lambda path: int(path.stem))
    return np.stack([np.asarray(Image.open(path)) for path in paths]), [p.parent.name for p in paths]


@pytest.mark.parametrize("dataset", ["synthetic", "folder"])
def test_simulate_shifts_the_days_and_validation_never_the_server_images(dataset, tmp_path):
    if dataset == "folder":
        for split, seed in (("train", 1), ("test", 2)):
            x, y = datasets.synthetic(60, "server", seed=seed)
            datasets.write_image_folder(x, y, datasets.CLASSES, tmp_path / "set" / split)
        dataset = str(tmp_path / "set")
    common = dict(dataset=dataset, per_day=8, pretrain_samples=20, validation_samples=10, seed=4)
    plain = DataSource(SimulationOptions(**common))
    shifted = DataSource(SimulationOptions(shift="dusk", **common))
    for a, b in zip(plain.server(), shifted.server()):
        assert np.array_equal(a, b)
    (vx, vy), (sx, sy) = plain.validation(), shifted.validation()
    assert np.array_equal(vy, sy) and np.array_equal(sx, SHIFTS["dusk"](vx, seed=[4, 0]))
    # Day 1 after 2 earlier sessions is day number 3: its images, unshifted, in the order drawn.
    if plain.dataset is None:
        x, y = datasets.synthetic(8, "device", seed=4 + 1000 + 3)
    else:
        x, y = plain.dataset.load_arrays("train", plain._day_indices(3)[0])
        plain.write_day(1, 2, tmp_path / "plain")  # the original files, extracted
        assert sorted(path.parent.name for path in (tmp_path / "plain").glob("*/*.png")) == sorted(
            datasets.CLASSES[label] for label in y)
    shifted.write_day(1, 2, tmp_path / "shifted")
    day_x, day_labels = read_folder(tmp_path / "shifted")
    assert day_labels == [datasets.CLASSES[label] for label in y]
    assert np.array_equal(day_x, SHIFTS["dusk"](x, seed=[4, 4]))


def test_odtctl_simulate_shift_help_is_one_line_and_creates_nothing(tmp_path):
    proc = odtctl("simulate", "--shift", "help", home=tmp_path / "home", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("Error: --shift takes one of: low_light (")
    proc = odtctl("simulate", "--shift", "Dusk", home=tmp_path / "home", check=False)
    assert proc.returncode == 1 and "use one of low_light, dusk," in proc.stderr
    proc = odtctl("simulate", "--shift", f"{tmp_path}/camera.py:night", home=tmp_path / "home",
                  check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"Error: --shift '{tmp_path}/camera.py:night': no such file")
    assert not (tmp_path / "home").exists()


def test_odtctl_simulate_refuses_a_shift_the_home_was_not_created_with(home):
    # An `odtctl init` home has an unshifted validation set: a shifted stream would be judged on it.
    proc = odtctl("simulate", "--shift", "fog", "--days", "1", home=home, check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith(f"Error: --shift fog: {home} was created without a shift, and its "
                                  "validation set is of that camera; pass the same --shift, or --fresh")


@pytest.mark.trains
def test_odtctl_simulate_refuses_a_dataset_of_other_classes_in_one_line(tmp_path):
    home = tmp_path / "home"
    odtctl("init", "--model", "tinycnn", "--classes", "sun,rain,snow", home=home)
    proc = odtctl("simulate", "--days", "1", home=home, check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("Error: --dataset synthetic: its classes (airplane, automobile,")
    assert proc.stderr.rstrip().endswith(f"are not the ones {home} serves (sun, rain, snow)")
