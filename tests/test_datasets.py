"""Synthetic images, image folders, real data sets (folders and tar archives) and daily draws."""

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import CIFAR, REPO
from PIL import Image

from odtd.errors import IngestError
from odtd.sim import datasets

# --- synthetic --------------------------------------------------------------------------------

def test_synthetic_is_deterministic_and_balanced():
    x1, y1 = datasets.synthetic(205, "server", seed=3)
    x2, y2 = datasets.synthetic(205, "server", seed=3)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert x1.shape == (205, 32, 32, 3) and x1.dtype == np.uint8 and y1.dtype == np.int64
    assert sorted(np.bincount(y1, minlength=10).tolist()) == [20] * 5 + [21] * 5
    assert not np.array_equal(y1[:20], np.arange(20) % 10)  # shuffled, not round-robin order
    assert not np.array_equal(datasets.synthetic(205, "server", seed=4)[0], x1)
    assert not np.array_equal(datasets.synthetic(205, "device", seed=3)[0], x1)
    empty_x, empty_y = datasets.synthetic(0)
    assert empty_x.shape == (0, 32, 32, 3) and empty_y.shape == (0,)


def test_synthetic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="domain='lab' is unknown; use one of server, device"):
        datasets.synthetic(10, "lab")
    with pytest.raises(ValueError, match="n=-1"):
        datasets.synthetic(-1)


def _features(x):
    """Translation-invariant features: low-frequency Fourier magnitudes and colour statistics."""
    gray = x.astype(np.float32).mean(-1) / 255
    spectrum = np.abs(np.fft.fft2(gray - gray.mean((1, 2), keepdims=True)))[:, :12, :12]
    pixels = x.reshape(len(x), -1, 3).astype(np.float32) / 255
    colour = [pixels.mean(1), pixels.std(1), np.percentile(pixels, 90, 1), np.percentile(pixels, 10, 1)]
    return np.concatenate([spectrum.reshape(len(x), -1)] + colour, axis=1)


def _nearest_mean(x_fit, y_fit):
    """A nearest-class-mean classifier on standardised features; returns its accuracy function."""
    fit = _features(x_fit)
    centre, spread = fit.mean(0), fit.std(0) + 1e-6
    means = np.stack([((fit[y_fit == c] - centre) / spread).mean(0) for c in range(10)])

    def accuracy(x, y):
        z = (_features(x) - centre) / spread
        return float(np.mean(((z[:, None] - means[None]) ** 2).sum(-1).argmin(1) == y))

    return accuracy


def test_synthetic_domains_are_learnable_and_shifted():
    server_test = datasets.synthetic(1000, "server", seed=1)
    device_test = datasets.synthetic(1000, "device", seed=1)
    on_server = _nearest_mean(*datasets.synthetic(2000, "server", seed=0))
    on_device = _nearest_mean(*datasets.synthetic(2000, "device", seed=0))
    server_to_server, server_to_device = on_server(*server_test), on_server(*device_test)
    device_to_device = on_device(*device_test)
    print(f"nearest class mean: server->server {server_to_server:.3f}, server->device "
          f"{server_to_device:.3f}, device->device {device_to_device:.3f} (chance 0.100)")
    assert server_to_server > 0.5 and device_to_device > 0.35  # both domains learnable
    assert server_to_device < server_to_server - 0.2  # the shift costs a server model
    assert server_to_device < device_to_device - 0.1  # and learning on device data wins it back


def test_importing_datasets_loads_no_tensorflow():
    code = "import sys, odtd.sim.datasets; sys.exit('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# --- image folders ----------------------------------------------------------------------------

def test_write_image_folder_round_trips_png_and_jpg(tmp_path):
    x, y = datasets.synthetic(20, "device", seed=1)
    paths = datasets.write_image_folder(x, y, datasets.CLASSES, tmp_path / "png", start_index=40)
    assert [p.relative_to(tmp_path / "png").as_posix() for p in paths[:2]] == [
        f"{datasets.CLASSES[y[0]]}/000040.png", f"{datasets.CLASSES[y[1]]}/000041.png"]
    assert all(np.array_equal(np.asarray(Image.open(p)), image) for p, image in zip(paths, x))
    jpgs = datasets.write_image_folder(x, y, datasets.CLASSES, tmp_path / "jpg", fmt="jpg")
    with Image.open(jpgs[0]) as image:
        assert image.format == "JPEG" and image.mode == "RGB"
        assert image.quantization[0][0] <= 2  # quality 95: the luma DC step is 2 (75 gives 8)
        assert np.abs(np.asarray(image).mean((0, 1)) - x[0].mean((0, 1))).max() < 2
    assert not list(tmp_path.rglob(".*"))  # no temporary files left behind


def test_write_image_folder_rejects_bad_input(tmp_path):
    x, y = datasets.synthetic(3)
    with pytest.raises(ValueError, match="fmt='gif' is not supported"):
        datasets.write_image_folder(x, y, datasets.CLASSES, tmp_path, fmt="gif")
    with pytest.raises(ValueError, match="need uint8 images"):
        datasets.write_image_folder(x.astype(np.float32), y, datasets.CLASSES, tmp_path)
    with pytest.raises(ValueError, match="do not index the 2 classes"):
        datasets.write_image_folder(x, np.array([0, 1, 2]), ["cat", "dog"], tmp_path)


# --- real data sets ---------------------------------------------------------------------------

def _tree(root: Path, splits=("train", "test"), classes=("dog", "cat"), per_class=3) -> None:
    """Real JPEG files, 40x30 (so loading resizes), a distinct red level per file."""
    for split in splits:
        for label in classes:
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (40, 30), (60 * i, 0, 200)).save(folder / f"{i}.jpg", quality=95)
    (root / "train" / "cat" / "._0.jpg").write_bytes(b"AppleDouble junk")  # hidden: ignored
    (root / "train" / "cat" / "notes.txt").write_text("not an image")


def _tar(source: Path, archive: Path, arcname: str) -> Path:
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source, arcname=arcname)
    return archive


def test_open_folder(tmp_path):
    _tree(tmp_path / "data")
    ds = datasets.open_dataset(tmp_path / "data")
    assert ds.splits() == ["test", "train"] and ds.classes == ["cat", "dog"]
    assert ds.files("train")[:2] == [("train/cat/0.jpg", 0), ("train/cat/1.jpg", 0)]
    assert [label for _, label in ds.files("test")] == [0, 0, 0, 1, 1, 1]
    assert ds.read_bytes("train/dog/2.jpg") == (tmp_path / "data/train/dog/2.jpg").read_bytes()
    x, y = ds.load_arrays("train")
    assert x.shape == (6, 32, 32, 3) and x.dtype == np.uint8 and y.tolist() == [0, 0, 0, 1, 1, 1]
    assert abs(int(x[2, 16, 16, 0]) - 120) < 8 and abs(int(x[2, 16, 16, 2]) - 200) < 8
    x, y = ds.load_arrays("test", indices=[5, 0], size=(20, 10))
    assert x.shape == (2, 10, 20, 3) and y.tolist() == [1, 0]
    nested = datasets.open_dataset(tmp_path)  # the splits under one top-level folder
    assert nested.files("train") == ds.files("train")


@pytest.mark.parametrize("arcname", ["", "cifar-10", "."])
def test_open_tar_with_and_without_top_folder(tmp_path, arcname):
    _tree(tmp_path / "data", classes=datasets.CLASSES[::-1], per_class=1)
    archive = _tar(tmp_path / "data", tmp_path / "data.tar.gz", arcname)
    ds = datasets.open_dataset(archive)
    assert ds.classes == list(datasets.CLASSES) and ds.splits() == ["test", "train"]
    assert [name for name, _ in ds.files("test")][:2] == ["test/airplane/0.jpg", "test/automobile/0.jpg"]
    x, y = ds.load_arrays("test", [9])
    assert x.shape == (1, 32, 32, 3) and y.tolist() == [9]
    out = ds.extract("test", ["test/truck/0.jpg", "test/cat/0.jpg"], tmp_path / "inbox")
    assert [p.relative_to(tmp_path / "inbox").as_posix() for p in out] == ["truck/0.jpg", "cat/0.jpg"]
    assert out[0].read_bytes() == (tmp_path / "data/test/truck/0.jpg").read_bytes()
    with pytest.raises(KeyError, match="has no image 'train/cat/0.jpg'"):
        ds.extract("test", ["train/cat/0.jpg"], tmp_path / "inbox")


def test_open_dataset_errors_name_the_path_and_the_layout(tmp_path):
    with pytest.raises(IngestError, match=r"missing: no such dataset; expected a folder or a tar archive "
                                          r"of <split>/<class>/<image>"):
        datasets.open_dataset(tmp_path / "missing")
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(IngestError, match="junk.tar.gz: not a readable tar archive"):
        datasets.open_dataset(tmp_path / "junk.tar.gz")
    flat = tmp_path / "flat"  # <class>/<image> without splits
    Image.new("RGB", (8, 8)).save((flat / "cat").mkdir(parents=True) or flat / "cat" / "0.png")
    with pytest.raises(IngestError, match=r"flat: no images in the layout <split>/<class>/<image>"):
        datasets.open_dataset(flat)
    with pytest.raises(IngestError, match="no images in the layout"):
        datasets.open_dataset(_tar(flat, tmp_path / "flat.tar", "."))
    _tree(tmp_path / "data")
    ds = datasets.open_dataset(tmp_path / "data")
    with pytest.raises(IngestError, match="no split 'val'; it has test, train"):
        ds.files("val")
    (tmp_path / "data/train/cat/0.jpg").write_bytes(b"\xff\xd8 truncated")
    with pytest.raises(IngestError, match=r"cannot decode train/cat/0.jpg .*damaged or not an image"):
        ds.load_arrays("train")
    with pytest.raises(KeyError, match="no image named 'train/cow/0.jpg'"):
        ds.read_bytes("train/cow/0.jpg")


# --- draws ------------------------------------------------------------------------------------

def test_take_per_class_is_interleaved_so_prefixes_are_balanced():
    y = np.array(["cat", "dog", "frog"] * 20 + ["cat"] * 10)
    picked = datasets.take_per_class(y, 15, seed=0)
    assert picked.dtype == np.int64 and len(set(picked.tolist())) == 45
    assert sorted(y[picked[:9]].tolist()) == ["cat"] * 3 + ["dog"] * 3 + ["frog"] * 3
    assert np.array_equal(picked, datasets.take_per_class(y, 15, seed=0))
    assert not np.array_equal(picked, datasets.take_per_class(y, 15, seed=1))
    names, counts = np.unique(y[datasets.take_per_class(y, 25, seed=0)], return_counts=True)
    assert dict(zip(names.tolist(), counts.tolist())) == {"cat": 25, "dog": 20, "frog": 20}  # all they have
    assert not set(datasets.take_per_class(y, 30, 0, exclude=picked).tolist()) & set(picked.tolist())


def test_daily_draws_are_disjoint_balanced_and_stable():
    y = np.repeat(np.arange(10), 100)
    exclude = datasets.take_per_class(y, 10, seed=0)
    draws = datasets.daily_draws(y, 5, 64, seed=1, exclude=exclude)
    flat = np.concatenate(draws)
    assert [len(d) for d in draws] == [64] * 5 and len(set(flat.tolist())) == 320
    assert not set(flat.tolist()) & set(exclude.tolist())
    assert all(set(np.bincount(y[d], minlength=10).tolist()) == {6, 7} for d in draws)
    assert np.bincount(y[flat], minlength=10).tolist() == [32] * 10  # the extras rotate
    longer = datasets.daily_draws(y, 9, 64, seed=1, exclude=exclude)
    assert all(np.array_equal(a, b) for a, b in zip(draws, longer))  # day d does not depend on days
    with pytest.raises(ValueError, match="15 days x 64 images need 960 images, but only 900 are left"):
        datasets.daily_draws(y, 15, 64, seed=1, exclude=exclude)


def test_daily_draws_share_out_a_class_that_runs_out():
    y = np.array([0] * 5 + [1] * 50 + [2] * 50)
    draws = datasets.daily_draws(y, 4, 15, seed=2)
    counts = [np.bincount(y[d], minlength=3).tolist() for d in draws]
    assert counts == [[5, 5, 5], [0, 8, 7], [0, 7, 8], [0, 8, 7]]
    assert len(set(np.concatenate(draws).tolist())) == 60


@pytest.mark.skipif(not CIFAR.exists(), reason=f"CIFAR-10 archive not at {CIFAR} (set ODTD_CIFAR10)")
def test_real_cifar10_archive(tmp_path):
    ds = datasets.open_dataset(CIFAR)
    assert ds.classes == list(datasets.CLASSES) and ds.splits() == ["test", "train"]
    train, test = ds.files("train"), ds.files("test")
    assert len(train) == 50000 and len(test) == 10000
    assert np.bincount([label for _, label in train]).tolist() == [5000] * 10
    x, y = ds.load_arrays("train", [0, 25000, 49999])
    assert x.shape == (3, 32, 32, 3) and x.dtype == np.uint8 and y.tolist() == [0, 5, 9]
    assert x.std() > 10  # real pictures, not blank
    path, = ds.extract("test", [test[0][0]], tmp_path)
    assert path.relative_to(tmp_path).as_posix() == "airplane/0000.jpg"
    assert Image.open(io.BytesIO(path.read_bytes())).size == (32, 32)
