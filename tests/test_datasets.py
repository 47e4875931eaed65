import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from odtd import datasets
from odtd.errors import IngestError

CIFAR = Path(os.environ.get("ODTD_CIFAR10", Path(__file__).resolve().parents[2] / "shared" / "datasets"
                            / "cifar10-jpeg.tar.gz"))


def test_synthetic_is_deterministic_balanced_and_shifted():
    x1, y1 = datasets.synthetic(200, "server", seed=3)
    x2, y2 = datasets.synthetic(200, "server", seed=3)
    assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    assert x1.shape == (200, 32, 32, 3) and x1.dtype == np.uint8
    assert np.bincount(y1).tolist() == [20] * 10
    # Learnable and shifted, without TensorFlow: nearest class mean fitted on server images.
    xs, ys = datasets.synthetic(2000, "server", seed=0)
    features = lambda x: x.reshape(len(x), -1).astype(np.float32) / 255
    means = np.stack([features(xs[ys == c]).mean(0) for c in range(10)])
    def accuracy(x, y):
        d = ((features(x)[:, None, :] - means[None]) ** 2).sum(-1)
        return float(np.mean(d.argmin(1) == y))
    server = accuracy(*datasets.synthetic(500, "server", seed=9))
    device = accuracy(*datasets.synthetic(500, "device", seed=9))
    assert server > 0.2  # far above chance (0.1)
    assert device < server  # the device domain is shifted


def test_write_image_folder_round_trips(tmp_path):
    x, y = datasets.synthetic(20, "device", seed=1)
    paths = datasets.write_image_folder(x, y, datasets.CLASSES, tmp_path, fmt="png")
    assert len(paths) == 20
    assert np.array_equal(np.asarray(Image.open(paths[0])), x[0])
    assert paths[0].parent.name == datasets.CLASSES[y[0]]


def _tree(root: Path):
    for split in ("train", "test"):
        for label in ("cat", "dog"):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (40, 30), (i * 40, 0, 0)).save(folder / f"{i}.jpg")


def test_open_folder_and_tar(tmp_path):
    _tree(tmp_path / "data")
    ds = datasets.open_dataset(tmp_path / "data")
    assert ds.splits() == ["test", "train"] and ds.classes == ["cat", "dog"]
    x, y = ds.load_arrays("train")
    assert x.shape == (6, 32, 32, 3) and sorted(y.tolist()) == [0, 0, 0, 1, 1, 1]
    archive = tmp_path / "data.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "data", arcname="top")  # one top-level folder
    from_tar = datasets.open_dataset(archive)
    assert len(from_tar.files("test")) == 6
    out = from_tar.extract("test", [from_tar.files("test")[0][0]], tmp_path / "out")
    assert out[0].read_bytes() == from_tar.read_bytes(from_tar.files("test")[0][0])


def test_bad_paths(tmp_path):
    with pytest.raises(IngestError, match="no such dataset"):
        datasets.open_dataset(tmp_path / "missing")
    (tmp_path / "junk.tar.gz").write_bytes(b"not a tar")
    with pytest.raises(IngestError, match="not a readable tar"):
        datasets.open_dataset(tmp_path / "junk.tar.gz")


def test_daily_draws_are_disjoint_and_balanced():
    y = np.repeat(np.arange(10), 100)
    exclude = datasets.take_per_class(y, 10, seed=0)
    draws = datasets.daily_draws(y, 5, 60, seed=1, exclude=exclude)
    flat = np.concatenate(draws)
    assert len(set(flat.tolist())) == 300 and not set(flat.tolist()) & set(exclude.tolist())
    assert all(np.bincount(y[d], minlength=10).tolist() == [6] * 10 for d in draws)


@pytest.mark.skipif(not CIFAR.exists(), reason=f"CIFAR-10 archive not at {CIFAR} (set ODTD_CIFAR10)")
def test_real_cifar10_archive():
    ds = datasets.open_dataset(CIFAR)
    assert ds.classes == list(datasets.CLASSES)
    assert len(ds.files("train")) == 50000 and len(ds.files("test")) == 10000
    x, y = ds.load_arrays("test", [0, 5000, 9999])
    assert x.shape == (3, 32, 32, 3) and y.tolist() == [0, 5, 9]
