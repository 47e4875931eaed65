import io
import json

import numpy as np
import pytest
from conftest import CLASSES, odtctl, write_images
from PIL import Image

from odtd.errors import IngestError
from odtd.home.create import seed_replay
from odtd.home.image_sets import load_validation_dir
from odtd.home.ingest import BadImage, Ingestor, decode_image, discover
from odtd.home.paths import Home
from odtd.policy import load_policy
from odtd.store.database import Store


@pytest.fixture
def ingestor(tmp_path):
    home = Home(tmp_path / "home")
    for directory in home.directories():
        directory.mkdir(parents=True, exist_ok=True)
    store = Store(home.db_path)
    return Ingestor(home, store, CLASSES, (32, 32), holdout_every=0)


def test_good_and_bad_files_in_one_batch(ingestor, tmp_path):
    src = tmp_path / "src"
    write_images(src, per_class=1)
    good = (src / "cat" / "0.png").read_bytes()
    (src / "cat" / "truncated.jpg").write_bytes(_jpeg_bytes()[:300])
    (src / "dog" / "empty.jpg").write_bytes(b"")
    (src / "bird" / "notes.png").write_text("this is not an image")
    (src / "unicorn").mkdir()
    (src / "unicorn" / "u.png").write_bytes(good)
    report = ingestor.ingest(discover(src, None), day="2026-11-22")
    reasons = {item["path"].split("/src/")[1]: item["reason"] for item in report.rejected_files}
    assert report.accepted == 10
    assert report.rejected == 4
    assert "corrupt or truncated" in reasons["cat/truncated.jpg"]
    assert reasons["dog/empty.jpg"] == "empty file (0 bytes)"
    assert reasons["bird/notes.png"] == "not an image Pillow can read"
    assert reasons["unicorn/u.png"].startswith("unknown label 'unicorn'")
    quarantined = sorted(p.name for p in ingestor.home.quarantine.iterdir())
    assert len([n for n in quarantined if n.endswith(".reason.txt")]) == 4
    # Sources are left alone by a CLI ingest.
    assert (src / "cat" / "truncated.jpg").exists()
    counts = ingestor.store.sample_counts()
    assert counts["pending"] == 10 and counts["quarantined"] == 4


def test_duplicates_are_counted_not_added(ingestor, tmp_path):
    src = tmp_path / "src"
    write_images(src, per_class=1)
    first = ingestor.ingest(discover(src, None))
    second = ingestor.ingest(discover(src, None))
    assert (first.accepted, second.accepted, second.duplicates) == (10, 0, 10)


def test_stored_content_addressed_and_resized(ingestor, tmp_path):
    path = tmp_path / "big.png"
    Image.new("L", (100, 60), color=128).save(path)
    report = ingestor.ingest(discover(path, "cat"))
    assert report.accepted == 1
    row = ingestor.store.samples("pending")[0]
    pixels = np.load(ingestor.home.root / row["array_path"], allow_pickle=False)
    assert pixels.shape == (32, 32, 3) and pixels.dtype == np.uint8
    stored = ingestor.home.root / row["stored_path"]
    assert stored.read_bytes() == path.read_bytes()
    assert stored.name.startswith(row["sha256"])


def test_csv_manifest(ingestor, tmp_path):
    src = tmp_path / "src"
    write_images(src, per_class=1, classes=["cat", "dog"])
    manifest = tmp_path / "m.csv"
    manifest.write_text("path,label\nsrc/cat/0.png,cat\nsrc/dog/0.png,horse\n")
    report = ingestor.ingest(discover(manifest, None))
    assert report.accepted == 2


def test_oversized_image_is_rejected_without_decoding():
    image = Image.new("1", (8000, 7000))  # 56 megapixels, tiny as a 1-bit PNG
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    with pytest.raises(BadImage, match="oversized"):
        decode_image(buf.getvalue(), (32, 32, 3))


def test_missing_path_and_single_file_without_label(tmp_path):
    with pytest.raises(IngestError, match="no such file or directory"):
        discover(tmp_path / "nope", None)
    (tmp_path / "a.png").write_bytes(b"x")
    with pytest.raises(IngestError, match="needs --label"):
        discover(tmp_path / "a.png", None)


def _jpeg_bytes() -> bytes:
    rng = np.random.default_rng(1)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _bare_home(root, input_shape, classes=("cat", "dog"), config_text=None) -> Home:
    """An initialised home without a model: what ingest reads (classes, input shape, odtd.yaml)."""
    home = Home(root)
    for directory in home.directories():
        directory.mkdir(parents=True, exist_ok=True)
    if config_text is not None:
        home.config_path.write_text(config_text)
    store = Store(home.db_path)
    store.set_meta(classes=list(classes), input_shape=list(input_shape))
    store.close()
    return home


def _save(path, image, fmt=None, **options):
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format=fmt, **options)
    return path


def _mixed_folder(root):
    """cat/ and dog/ of every format and mode ingest takes, and five files that are no image."""
    rng = np.random.default_rng(3)
    photo = Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))
    frames = [Image.new("RGB", (30, 20), (9, 9, 9)), Image.new("RGB", (30, 20), (200, 0, 0))]
    good = [
        _save(root / "cat" / "photo.jpg", photo, quality=90),
        _save(root / "cat" / "small.png", photo.resize((20, 50)).convert("RGBA")),
        _save(root / "cat" / "grey.bmp", photo.convert("L")),
        _save(root / "cat" / "bits.bmp", photo.convert("1")),
        _save(root / "cat" / "print.jpeg", photo.convert("CMYK")),
        _save(root / "dog" / "palette.png", photo.convert("P"), transparency=3),
        _save(root / "dog" / "deep.png", Image.fromarray(
            rng.integers(0, 65536, (40, 30), dtype=np.uint16))),
        _save(root / "dog" / "lossy.webp", photo.crop((0, 0, 300, 100)), quality=80),
        _save(root / "dog" / "moving.gif", frames[0], save_all=True, append_images=frames[1:]),
        _save(root / "dog" / "scan.tiff", photo.resize((64, 64))),
        _save(root / "dog" / "no-suffix", photo.resize((33, 97)), "PNG"),
    ]
    (root / "dog" / "empty.jpg").write_bytes(b"")
    (root / "dog" / "notes.webp").write_text("not a picture")
    (root / "cat" / "cut.png").write_bytes((root / "cat" / "small.png").read_bytes()[:200])
    (root / "cat" / "noise.bmp").write_bytes(rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())
    _save(root / "horse" / "h.png", photo.resize((8, 8)))
    reasons = {"dog/empty.jpg": "empty file (0 bytes)", "dog/notes.webp": "not an image Pillow can read",
               "cat/cut.png": "corrupt or truncated image (", "cat/noise.bmp": "not an image Pillow can read",
               "horse/h.png": "unknown label 'horse'"}
    return good, reasons


def test_mixed_formats_into_a_one_channel_padded_model(tmp_path):
    home = _bare_home(tmp_path / "home", (24, 40, 1))
    store = home.open_store()
    ingestor = Ingestor(home, store, ["cat", "dog"], (40, 24), holdout_every=0, channels=1,
                        resize="pad")
    good, reasons = _mixed_folder(tmp_path / "src")
    report = ingestor.ingest(discover(tmp_path / "src", None))
    got = {item["path"].split("/src/")[1]: item["reason"] for item in report.rejected_files}
    assert (report.accepted, report.rejected) == (len(good), len(reasons))
    assert sorted(got) == sorted(reasons)
    assert all(got[name].startswith(reason) and "\n" not in got[name] for name, reason in reasons.items())
    rows = {row["original_path"]: row for row in store.samples("pending")}
    for path in good:  # nothing good is lost: the original bytes and the model's pixels
        row = rows[str(path)]
        assert (home.root / row["stored_path"]).read_bytes() == path.read_bytes()
        pixels = np.load(home.root / row["array_path"], allow_pickle=False)
        assert pixels.shape == (24, 40, 1) and pixels.dtype == np.uint8
    # 640x480 fitted to 32x24 in 40x24: 4 columns of zeros each side.
    photo = np.load(home.root / rows[str(good[0])]["array_path"])
    assert photo[:, :4].max() == 0 and photo[:, 36:].max() == 0 and photo[:, 4:36].min() > 0
    assert rows[str(good[-1])]["stored_path"].endswith(".img")
    quarantined = list(home.quarantine.glob("*.reason.txt"))
    assert sorted(q.read_text().strip() for q in quarantined) == sorted(got.values())
    store.close()


def test_for_home_takes_the_models_shape_and_odtd_yaml(tmp_path):
    home = _bare_home(tmp_path / "home", (24, 40, 1), config_text="images:\n  resize: crop\n")
    store = home.open_store()
    ingestor = Ingestor.for_home(home, store)
    assert (ingestor.input_shape, ingestor.resize, ingestor.antialias) == ((24, 40, 1), "crop", False)
    assert ingestor.class_list == ["cat", "dog"]
    wide = Image.new("L", (120, 24), 0)
    wide.paste(255, (40, 0, 80, 24))  # white in the middle third
    _save(tmp_path / "w" / "cat" / "wide.png", wide)
    assert ingestor.ingest(discover(tmp_path / "w", None)).accepted == 1
    pixels = np.load(home.root / store.samples("pending")[0]["array_path"])
    assert pixels.shape == (24, 40, 1) and pixels.min() == 255  # the crop is the white third
    store.close()


def test_odtctl_ingest_a_folder_of_mixed_formats(tmp_path):
    home = _bare_home(tmp_path / "home", (24, 40, 3))
    good, reasons = _mixed_folder(tmp_path / "src")
    proc = odtctl("ingest", str(tmp_path / "src"), "--json", home=home.root)
    report = json.loads(proc.stdout)
    assert (report["accepted"], report["rejected"]) == (len(good), len(reasons))
    got = {item["path"].split("/src/")[1]: item["reason"] for item in report["rejected_files"]}
    assert all(got[name].startswith(reason) for name, reason in reasons.items())
    store = home.open_store()
    rows = store.samples("pending") + store.samples("holdout")  # one in 8 is held out
    arrays = [np.load(home.root / row["array_path"]) for row in rows]
    store.close()
    assert len(arrays) == len(good) and {a.shape for a in arrays} == {(24, 40, 3)}


def test_validation_dir_of_mixed_sizes_and_modes(tmp_path, caplog):
    good, _ = _mixed_folder(tmp_path / "val")
    for name in ("cat/cut.png", "cat/noise.bmp", "dog/empty.jpg", "dog/notes.webp"):
        (tmp_path / "val" / name).unlink()
    (tmp_path / "val" / "horse" / "h.png").unlink()
    (tmp_path / "val" / "horse").rmdir()
    (tmp_path / "val" / "dog" / "cut.png").write_bytes(good[1].read_bytes()[:200])
    x, y = load_validation_dir(tmp_path / "val", ["cat", "dog"], (24, 40, 1), resize="pad")
    assert x.shape == (len(good), 24, 40, 1) and x.dtype == np.uint8
    assert y.tolist() == [0] * 5 + [1] * 6
    assert "cut.png skipped: corrupt or truncated image" in caplog.text
    assert x[0][:, :4].max() == 0  # cat/bits.bmp, 640x480, padded
    rgb, _ = load_validation_dir(tmp_path / "val", ["cat", "dog"], (24, 40, 3))
    assert rgb.shape == (len(good), 24, 40, 3) and rgb[0][:, :4].max() > 0  # stretched
    with pytest.raises(IngestError, match=r"label 'dog' is not one of the classes"):
        load_validation_dir(tmp_path / "val", ["cat", "bird"], (24, 40, 1))


def test_replay_seed_takes_the_models_channels_and_resize(tmp_path):
    home = _bare_home(tmp_path / "home", (16, 16, 1))
    store = home.open_store()
    src = tmp_path / "replay"
    write_images(src, per_class=3, classes=["cat", "dog"], size=48)
    _save(src / "cat" / "wide.png", Image.new("RGB", (64, 16), (255, 255, 255)))
    policy = load_policy(home.root / "policy.yaml")  # missing: the default policy
    result = seed_replay(home, store, discover(src, None), ["cat", "dog"], [16, 16, 1], policy,
                         resize="pad")
    assert result["accepted"] == 7 and result["size"] == 7
    shapes = {np.load(home.root / row["array_path"]).shape for row in store.samples("trained")}
    assert shapes == {(16, 16, 1)}
    wide = [row for row in store.samples("trained") if row["original_path"].endswith("wide.png")]
    pixels = np.load(home.root / wide[0]["array_path"])[:, :, 0]
    assert pixels[:6].max() == 0 and pixels[6:10].min() == 255 and pixels[10:].max() == 0
    store.close()
