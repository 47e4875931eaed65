"""The home on a disk of its own, and that disk full: on real filesystems (tests/mounts.py).

A small tmpfs stands for the device's data disk (an NVMe drive, an SD card, a USB stick): a
filesystem other than the temporary directory's, of a size a test can fill.
"""

import errno
import importlib.metadata
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import CLASSES, REPO, odtctl, odtctl_json, write_images
from mounts import MB, fill, free_bytes, tmpfs

from odtd import atomic
from odtd.config import StorageConfig
from odtd.errors import StorageError, sqlite_storage_error, storage_error
from odtd.home.disk import make_room
from odtd.home.ingest import Ingestor, discover
from odtd.home.paths import Home
from odtd.home.replay_buffer import update_buffer
from odtd.home.versions import ModelRepo
from odtd.policy import ReplayPolicy

KERAS_FILES = REPO / "tests" / "fixtures" / "keras"


def storage_config(home: Path, min_free_mb: float, prune: str = "[runs, versions]") -> None:
    with open(home / "odtd.yaml", "a") as handle:
        handle.write(f"storage:\n  min_free_mb: {min_free_mb}\n  prune: {prune}\n")


def home_on(disk: Path, home: Path, min_free_mb: float | None = None) -> Path:
    """A copy of the test's home on ``disk``, with that storage floor (None: the default)."""
    shutil.copytree(home, disk / "home")
    if min_free_mb is not None:
        storage_config(disk / "home", min_free_mb)
    return disk / "home"


def one_error_line(proc) -> str:
    """The one ``Error:`` line a failed command printed (progress lines aside), no traceback."""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error: ")]
    assert proc.returncode != 0
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return errors[0]


def check_home(home: Path) -> None:
    """SQLite's integrity check, every sample row with its files, no file without a row."""
    db = sqlite3.connect(home / "odtd.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        named = set()
        for stored, array in db.execute("SELECT stored_path, array_path FROM samples"):
            assert (home / stored).is_file() and (home / array).is_file()
            named |= {stored, array}
    finally:
        db.close()
    on_disk = {str(p.relative_to(home)) for p in (home / "samples").rglob("*") if p.is_file()}
    assert on_disk == named


# -- staged writes ---------------------------------------------------------------------------


def test_a_staged_write_that_fills_the_disk_leaves_the_old_file_and_nothing_else(tmp_path):
    with tmpfs(tmp_path / "disk", 1) as disk:
        target = disk / "weights.npz"
        atomic.write_bytes(target, b"old")
        with pytest.raises(OSError) as failure:
            atomic.write_bytes(target, b"\1" * (2 * MB))
        assert failure.value.errno == errno.ENOSPC
        assert target.read_bytes() == b"old"
        assert sorted(p.name for p in disk.iterdir()) == ["weights.npz"]


def test_a_move_across_filesystems_copies_and_removes_the_source(tmp_path):
    with tmpfs(tmp_path / "a", 2) as first, tmpfs(tmp_path / "b", 2) as second:
        (first / "x.npz").write_bytes(b"weights")
        with pytest.raises(OSError) as crossing:
            os.replace(first / "x.npz", second / "x.npz")
        assert crossing.value.errno == errno.EXDEV  # what init met before it staged in the home
        atomic.move(first / "x.npz", second / "x.npz")
        assert (second / "x.npz").read_bytes() == b"weights" and not (first / "x.npz").exists()
        assert sorted(p.name for p in second.iterdir()) == ["x.npz"]


def test_a_staged_directory_appears_whole_or_not_at_all(tmp_path):
    with tmpfs(tmp_path / "disk", 1) as disk:
        with atomic.staged_directory(disk / "v3") as staging:
            (Path(staging) / "weights.npz").write_bytes(b"weights")
            (Path(staging) / "manifest.json").write_text("{}")
            assert not (disk / "v3").exists()  # not visible until whole
        assert sorted(p.name for p in (disk / "v3").iterdir()) == ["manifest.json", "weights.npz"]
        with pytest.raises(OSError) as failure:
            with atomic.staged_directory(disk / "v4") as staging:
                (Path(staging) / "weights.npz").write_bytes(b"\1" * (2 * MB))
        assert failure.value.errno == errno.ENOSPC
        assert sorted(p.name for p in disk.iterdir()) == ["v3"]


def test_a_failed_block_removes_what_it_made_and_keeps_what_was_there(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "odtd.yaml").write_text("kept: yes\n")
    (home / "policy.yaml").write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic.undone_on_failure(home):
            (home / "samples").mkdir()
            (home / "samples" / "a.png").write_bytes(b"png")
            atomic.write_text(home / "policy.yaml", "new\n")  # replaced: a new inode
            raise RuntimeError("the worker refused the model")
    assert sorted(p.name for p in home.iterdir()) == ["odtd.yaml"]
    assert (home / "odtd.yaml").read_text() == "kept: yes\n"
    with pytest.raises(RuntimeError):
        with atomic.undone_on_failure(tmp_path / "new-home"):
            (tmp_path / "new-home").mkdir()
            raise RuntimeError("refused")
    assert not (tmp_path / "new-home").exists()


# -- init ------------------------------------------------------------------------------------


@pytest.mark.trains
def test_init_on_a_disk_of_its_own_works_as_in_the_temporary_directory(tmp_path):
    keras = "k3" if int(importlib.metadata.version("keras").split(".")[0]) == 3 else "k2"
    model_file = KERAS_FILES / keras / "cnn_softmax.keras"
    with tmpfs(tmp_path / "disk", 24) as disk:
        for args in (["--model", "tinycnn"],
                     ["--model-file", str(model_file), "--classes", "cat,dog,owl,fox"]):
            here, there = tmp_path / f"home-{args[0]}", disk / f"home-{args[0]}"
            summaries = [odtctl_json("init", *args, home=home) for home in (here, there)]
            for summary in summaries:
                summary.pop("home")
                assert summary["policy"].pop("file").endswith("/policy.yaml")
            assert summaries[0] == summaries[1]
            versions = [odtctl_json("models", "versions", home=home) for home in (here, there)]
            assert versions[0][0]["sha256"] == versions[1][0]["sha256"]
            assert sorted(p.name for p in there.iterdir() if p.name.startswith(".")) == []
            check_home(there)
        write_images(tmp_path / "imgs", per_class=1)
        storage_config(disk / "home---model", 1)  # the default floor (256 MB) is the disk's size
        assert odtctl_json("ingest", str(tmp_path / "imgs"), home=disk / "home---model")["accepted"]


@pytest.mark.trains
def test_a_failed_init_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    write_images(tmp_path / "replay", per_class=40, size=64)  # ~5 MB of PNGs, more than fits
    with tmpfs(tmp_path / "disk", 3) as disk:
        proc = odtctl("init", "--model", "tinycnn", "--replay", str(tmp_path / "replay"),
                      home=disk / "home", check=False)
        line = one_error_line(proc)
        assert "no space left on device (ENOSPC)" in line and str(disk) in line
        assert list(disk.iterdir()) == []  # no half-made home: init may be run again
        proc = odtctl("status", home=disk / "home", check=False)
        assert "no such directory" in one_error_line(proc)


# -- a full disk: ingest ----------------------------------------------------------------------


def test_ingest_below_the_floor_refuses_with_the_free_and_needed_space(home, tmp_path):
    write_images(tmp_path / "imgs", per_class=20, size=48)
    sources = sorted(p for p in (tmp_path / "imgs").rglob("*") if p.is_file())
    with tmpfs(tmp_path / "disk", 12) as disk:
        home_on(disk, home, 1)
        fill(disk, 2 * MB)
        proc = odtctl("ingest", str(tmp_path / "imgs"), home=disk / "home", check=False)
        line = one_error_line(proc)
        assert "not enough disk space" in line and "MB free" in line and "needs ~" in line
        assert "ingesting 200 files" in line and "the files were left where they are" in line
        assert odtctl_json("status", home=disk / "home")["samples"]["total"] == 0
        assert not any(p.is_file() for p in (disk / "home" / "samples").rglob("*"))
        assert sorted(p for p in (tmp_path / "imgs").rglob("*") if p.is_file()) == sources
        (disk / "ballast").unlink()  # space freed: the same ingest goes through
        assert odtctl_json("ingest", str(tmp_path / "imgs"), home=disk / "home")["accepted"] == 200
        check_home(disk / "home")


def test_a_disk_filled_to_the_last_byte_still_shows_status_and_says_full(home, tmp_path):
    # Another program (a camera) fills the disk completely: SQLite cannot extend its -shm file
    # then, and says "disk I/O error". status still reads the home; the rest says ENOSPC.
    write_images(tmp_path / "imgs", per_class=2)
    with tmpfs(tmp_path / "disk", 8) as disk:
        odtd_home = home_on(disk, home, 1)
        with open(disk / "ballast", "wb") as handle, pytest.raises(OSError):
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        assert free_bytes(disk) == 0
        status = odtctl_json("status", home=odtd_home)
        assert status["storage"]["free_bytes"] == 0 and "ENOSPC" in status["storage"]["problem"]
        for command in (("ingest", str(tmp_path / "imgs")), ("train-now", "--foreground")):
            line = one_error_line(odtctl(*command, home=odtd_home, check=False))
            assert ("no space left" in line or "not enough disk space" in line), line
            assert "I/O error" not in line, line
        (disk / "ballast").unlink()
        assert odtctl_json("ingest", str(tmp_path / "imgs"), home=odtd_home)["accepted"] == 20
        check_home(odtd_home)


def test_a_disk_that_fills_during_an_ingest_stops_it_whole(home, tmp_path):
    # No floor (storage=None) and a disk smaller than the images: the ingest meets ENOSPC.
    write_images(tmp_path / "inbox", per_class=20, size=48)
    with tmpfs(tmp_path / "disk", 8) as disk:
        odtd_home = Home(home_on(disk, home))
        fill(disk, 1 * MB)
        store = odtd_home.open_store()
        try:
            files = discover(tmp_path / "inbox", None)
            ingestor = Ingestor(odtd_home, store, CLASSES, (32, 32))
            with pytest.raises(StorageError, match=r"no space left on device \(ENOSPC\).*files "
                               r"were stored, the rest were left where they are") as full:
                ingestor.ingest(files, move=True)
            stored = store.sample_counts()["total"]
        finally:
            store.close()
        assert 0 < stored < 200 and f"{stored} of 200 files were stored" in str(full.value)
        left = [p for p in (tmp_path / "inbox").rglob("*") if p.is_file()]
        assert len(left) == 200 - stored  # every file not stored waits in the inbox
        check_home(disk / "home")


def test_the_daemons_inbox_ingest_on_a_full_disk_keeps_the_files(home, tmp_path):
    write_images(tmp_path / "drop", per_class=10, size=48)
    with tmpfs(tmp_path / "disk", 8) as disk:
        home_on(disk, home, 1)
        shutil.copytree(tmp_path / "drop", disk / "home" / "inbox", dirs_exist_ok=True)
        files = sorted(p for p in (disk / "home" / "inbox").rglob("*") if p.is_file())
        fill(disk, 1 * MB)
        proc = odtctl_task("ingest", disk / "home", json.dumps([[str(p), p.parent.name] for p in files]))
        assert proc.returncode == 1 and "Traceback" not in proc.stderr
        assert "not enough disk space" in json.loads(proc.stdout.splitlines()[-1])["error"]
        assert sorted(p for p in (disk / "home" / "inbox").rglob("*") if p.is_file()) == files


def odtctl_task(task: str, home: Path, stdin: str = ""):
    return subprocess.run([sys.executable, "-m", "odtd.daemon.tasks", task, "--home", str(home)],
                          input=stdin, capture_output=True, text=True, timeout=120, cwd=REPO)


# -- a full disk: sessions ----------------------------------------------------------------------


def test_a_session_that_would_not_fit_is_skipped_and_the_first_after_space_is_freed_trains(
        home, tmp_path):
    write_images(tmp_path / "imgs", per_class=6)
    with tmpfs(tmp_path / "disk", 16) as disk:
        home_on(disk, home, 1)
        odtctl("ingest", str(tmp_path / "imgs"), home=disk / "home")
        current = (disk / "home" / "models/tinycnn/current").read_text()
        fill(disk, int(1.5 * MB))  # above the floor, below the floor plus what a session writes
        skipped = odtctl_json("train-now", "--foreground", home=disk / "home")
        assert skipped["outcome"] == "skipped"
        assert skipped["reason"].startswith("not enough disk space for ") and \
            "this session needs ~" in skipped["reason"] and "job data" in skipped["reason"]
        assert skipped["steps"] is None  # no worker was started
        assert not (disk / "home" / "runs" / f"session-{skipped['id']}").exists()
        status = odtctl_json("status", home=disk / "home")
        assert status["storage"]["free_bytes"] < 2 * MB and status["storage"]["problem"] is None
        assert status["storage"]["min_free_bytes"] == MB
        assert status["samples"]["pending"] == 54  # nothing lost: 60 less the held-out
        assert "odtd_storage_free_bytes" in odtctl("metrics", home=disk / "home").stdout
        (disk / "ballast").unlink()
        trained = odtctl_json("train-now", "--foreground", home=disk / "home")
        assert trained["outcome"] == "promoted", trained["reason"]
        assert (disk / "home" / "models/tinycnn/current").read_text() != current
        check_home(disk / "home")


def test_pruning_goes_runs_then_versions_then_trained_samples_and_spares_what_is_needed(home, tmp_path):
    write_images(tmp_path / "imgs", per_class=30, size=48)
    with tmpfs(tmp_path / "disk", 24) as disk:
        home_on(disk, home, 0)
        odtd_home = Home(disk / "home")
        store = odtd_home.open_store()
        try:
            Ingestor.for_home(odtd_home, store).ingest(discover(tmp_path / "imgs", None),
                                                       day="2026-11-01")
            rows = store.samples("pending")
            seed, device, pending = rows[:180], rows[180:200], rows[200:]
            store.mark_trained([r["sha256"] for r in seed], session_id=0)  # the replay seed's
            store.mark_trained([r["sha256"] for r in device], session_id=1)  # a session's
            update_buffer(store, ReplayPolicy(capacity_samples=20), seed, session_id=0,
                          root=odtd_home.root)
            buffered = {e["sha256"] for e in store.replay_buffer()}
            repo = ModelRepo(odtd_home.models, "tinycnn")
            for parent in range(3):  # v1..v3, current v3 (parent v2)
                version, manifest = repo.add_version(repo.weights_path(parent), classes=CLASSES,
                                                     input_shape=[32, 32, 3], param_count=1,
                                                     parent=parent)
                store.add_model_version({"model": "tinycnn", "version": version, "parent": parent,
                                         "session_id": None, "sha256": manifest["sha256"],
                                         "param_count": 1, "accuracy": None})
            repo.set_current(3)
            (odtd_home.runs / "session-1").mkdir()
            (odtd_home.runs / "session-1" / "worker.stderr").write_bytes(b"\0" * 100_000)
            free = free_bytes(disk)
            # Room for what runs/ and the versions free, and ~100 samples more: not the rest.
            need = free + 100_000 + 3 * repo.weights_path(0).stat().st_size + 100 * 16_000
            storage = StorageConfig(min_free_mb=0, prune=["samples", "versions", "runs"])
            pruned = make_room(odtd_home, store, storage, need, keep_versions=2)
            assert pruned.runs == 1 and pruned.versions == [0, 1]
            assert 0 < pruned.samples < 180 - len(buffered) and pruned.freed_bytes > 0
            left = {r["sha256"] for r in store.samples("trained")}
            assert buffered <= left  # the replay buffer stays
            assert {r["sha256"] for r in device} <= left  # the newest a session trained on too
            assert {r["sha256"] for r in store.samples("pending")} == {r["sha256"] for r in pending}
            assert store.sample_counts()["pruned"] == pruned.samples
            assert repo.versions() == [2, 3] and repo.current() == 3
            event = store.events(kind="pruned")[0]
            assert json.loads(event["data"])["samples"] == pruned.samples
            # A pruned image sent again is a duplicate, not a new sample.
            gone = store.iter_query("SELECT sha256 FROM pruned_samples LIMIT 1")
            assert store.has_sample(next(gone)["sha256"])
        finally:
            store.close()
        check_home(disk / "home")
        status = odtctl_json("status", home=disk / "home")["storage"]["pruned"]
        assert status["times"] == 1 and status["samples"] == pruned.samples


# -- a full disk: export ----------------------------------------------------------------------


def test_an_export_to_a_full_disk_is_one_line_leaves_nothing_and_works_once_freed(home, tmp_path):
    with tmpfs(tmp_path / "usb", 1) as usb:
        fill(usb, 8 * 1024)
        proc = odtctl("models", "export", "0", "--out", str(usb / "model.npz"), home=home,
                      check=False)
        line = one_error_line(proc)
        assert "no space left on device (ENOSPC)" in line and str(usb) in line
        assert sorted(p.name for p in usb.iterdir()) == ["ballast"]
        (usb / "ballast").unlink()
        done = odtctl_json("models", "export", "0", "--out", str(usb / "model.npz"), home=home)
        assert done["sha256"] == json.loads(
            (home / "models/tinycnn/v0/manifest.json").read_text())["sha256"]
        assert sorted(p.name for p in usb.iterdir()) == ["model.npz"]
        with np.load(usb / "model.npz") as weights:
            assert weights.files


# -- one line for each filesystem error ----------------------------------------------------------


@pytest.mark.parametrize("code,says", [
    (errno.ENOSPC, "no space left on device (ENOSPC); free space on that disk"),
    (errno.EROFS, "read-only file system (EROFS); the filesystem is read-only"),
    (errno.EXDEV, "(EXDEV); a rename crossed filesystems"),
    (errno.EACCES, "permission denied (EACCES); give the user odtd runs as read and write access"),
    (errno.EIO, "input/output error (EIO); the disk failed or was removed"),
])
def test_each_filesystem_error_is_one_line_naming_the_path_and_the_fix(code, says):
    line = str(storage_error(OSError(code, os.strerror(code), "/data/odtd/odtd.db")))
    assert line.startswith("/data/odtd/odtd.db: ") and says in line and "\n" not in line


def test_a_database_sqlite_may_not_write_says_read_only_or_permissions(tmp_path):
    db = tmp_path / "odtd.db"
    sqlite3.connect(db).close()
    readonly = sqlite3.OperationalError("attempt to write a readonly database")
    assert "(EROFS)" in str(sqlite_storage_error(readonly, str(db)))  # root may write it
    assert "(ENOSPC)" in str(sqlite_storage_error(
        sqlite3.OperationalError("database or disk is full"), str(db)))
    assert sqlite_storage_error(sqlite3.OperationalError("no such table: x"), str(db)) is None


def test_sqlites_disk_io_error_is_judged_by_the_homes_disk_not_the_working_directorys(tmp_path):
    # SQLite's "disk I/O error" carries no path: on a full data disk it is ENOSPC, whatever
    # disk the process happens to run in (the working directory here has room).
    from odtd.errors import as_odtd_error

    error = sqlite3.OperationalError("disk I/O error")
    with tmpfs(tmp_path / "disk", 2) as disk:
        db = disk / "odtd.db"
        sqlite3.connect(db).close()
        fill(disk, 0)
        assert "(ENOSPC)" in str(as_odtd_error(error, db)) and str(db) in str(as_odtd_error(error, db))
        assert "(EIO)" in str(as_odtd_error(error))  # judged by the working directory's disk


def test_a_home_this_user_may_not_write_is_one_line_naming_the_fix(home, tmp_path):
    # Root without CAP_DAC_OVERRIDE obeys file modes, as the odtd user does.
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to drop the capability that overrides file modes")
    write_images(tmp_path / "imgs", per_class=1)
    for path in [home, *home.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)  # read-only for everyone
    try:
        proc = subprocess.run(
            ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps",
             "-dac_override,-dac_read_search", "--", sys.executable, "-m", "odtd.cli", "--home",
             str(home), "ingest", str(tmp_path / "imgs")],
            capture_output=True, text=True, timeout=120, cwd=REPO)
    finally:
        for path in [home, *home.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    line = one_error_line(proc)
    assert "permission denied (EACCES)" in line and str(home) in line
    assert "give the user odtd runs as read and write access" in line
