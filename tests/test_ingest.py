import numpy as np
import pytest
from conftest import CLASSES, write_images
from PIL import Image

from odtd.errors import IngestError
from odtd.home.ingest import BadImage, Ingestor, decode_image, discover
from odtd.home.paths import Home
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
    import io

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
    import io

    rng = np.random.default_rng(1)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()
