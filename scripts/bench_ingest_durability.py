"""What durability costs an ingest: odtd's flushes against none, on a given filesystem.

odtd's ingest flushes each sample's two files before its row commits, and the database runs
``synchronous=FULL`` (docs/storage.md). This ingests the same images into copies of one home,
as odtd does and with both turned off (``synchronous=NORMAL``, no file flushes, patched in
this process only), in turns, and prints JSON: images per second of each, the median of
``--repeats`` runs. Put ``--dir`` on the disk the home will live on (an SD card flushes far
slower than the development machine's virtual disk).

    python scripts/bench_ingest_durability.py [--images 300] [--repeats 3] [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_power_loss import machine
from PIL import Image

from odtd.home import ingest
from odtd.home.ingest import Ingestor, discover
from odtd.home.paths import Home

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def unflushed(stored: Path, data: bytes, array: Path, pixels: np.ndarray) -> None:
    """``ingest._write_sample_files`` without its flushes (the comparison only)."""
    stored.write_bytes(data)
    np.save(array, pixels, allow_pickle=False)


def ingest_once(template: Path, work: Path, images: Path, durable: bool) -> float:
    """Ingest ``images`` into a fresh copy of ``template``; the seconds it took."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(template, work)
    home = Home(work)
    store = home.open_store()
    written = ingest._write_sample_files
    try:
        if not durable:
            store.db.execute("PRAGMA synchronous=NORMAL")
            ingest._write_sample_files = unflushed
        files = discover(images, None)
        started = time.perf_counter()
        report = Ingestor.for_home(home, store).ingest(files, day="2026-11-28")
        seconds = time.perf_counter() - started
    finally:
        ingest._write_sample_files = written
        store.close()
    assert report.accepted == len(files), report.as_dict()
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", help="where the homes go (default: the temporary directory)")
    parser.add_argument("--json", action="store_true", help="JSON only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_ingest-", dir=args.dir) as tmp:
        root = Path(tmp)
        env = dict(os.environ, ODTD_HOME=str(root / "template"))
        done = subprocess.run([sys.executable, "-m", "odtd.cli", "init", "--model", "tinycnn"],
                              capture_output=True, text=True, env=env, cwd=REPO)
        if done.returncode:
            raise SystemExit(done.stderr)
        (root / "template" / "odtd.yaml").write_text("storage:\n  min_free_mb: 0\n")
        rng = np.random.default_rng(0)
        for i in range(args.images):
            folder = root / "images" / CLASSES[i % len(CLASSES)]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                folder / f"{i}.png")
        seconds: dict[str, list[float]] = {"odtd": [], "unflushed": []}
        for _ in range(args.repeats):
            for mode in seconds:  # in turns: a drift of the machine touches both alike
                seconds[mode].append(ingest_once(root / "template", root / "home", root / "images",
                                                 durable=mode == "odtd"))
                if not args.json:
                    print(f"{mode}: {seconds[mode][-1]:.2f} s", file=sys.stderr)
        stat = os.statvfs(root)
        fs = subprocess.run(["stat", "-f", "-c", "%T", str(root)], capture_output=True,
                            text=True).stdout.strip()
    rates = {mode: round(args.images / statistics.median(values), 1)
             for mode, values in seconds.items()}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    print(json.dumps({
        "benchmark": "ingest_durability", "commit": commit, "machine": machine(),
        "filesystem": fs, "block_bytes": stat.f_bsize, "images": args.images,
        "images_per_s": rates, "seconds": seconds,
        "durable_cost": round(rates["unflushed"] / rates["odtd"], 2),
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
