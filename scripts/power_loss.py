"""Power loss at any point: odtd's operations killed at every write and at random moments.

Each run copies one home, runs an operation's real process (the daemon's inbox task, ``odtctl
train-now --foreground`` with its trainer worker, ``odtctl models export``) under
scripts/fault_inject.py, which SIGKILLs it at its N-th write (as a power cut would stop it),
or fails that write (``ENOSPC``, ``EIO``), or SIGKILLs it at a random moment; then checks the
home (`check_home`), recovers it as odtd would (the task again, a session's recovery, the
export again) and checks it again with the operation's own invariants (`Scenario`).

scripts/bench_power_loss.py runs 200 and more kill points per operation; tests/test_power_loss.py
a few of each.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
INJECTOR = Path(__file__).resolve().with_name("fault_inject.py")
OPERATIONS = ("ingest", "session", "promotion", "export")


# -- what must hold -----------------------------------------------------------------------------

def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_home(home: Path, *, recovered: bool) -> list[str]:
    """The invariants every moment keeps, and with ``recovered`` those recovery restores.

    At any moment: SQLite's integrity check; every sample row with its files; ``current``
    naming a complete version (its weights match its manifest). Once recovered (what the next
    session or task does first): a current version made by a session only if the database says
    that session promoted it (else its samples, still pending, would train twice); no sample
    file without a row, no version without a row, no staging directory, no job data of a
    finished session, no staged temporary file.
    """
    found: list[str] = []
    db = sqlite3.connect(f"file:{home / 'odtd.db'}?mode=ro", uri=True)
    try:
        verdict = db.execute("PRAGMA integrity_check").fetchone()[0]
        if verdict != "ok":
            found.append(f"integrity_check: {verdict}")
        named = set()
        for sha, stored, array in db.execute("SELECT sha256, stored_path, array_path FROM samples"):
            named |= {stored, array}
            if not (home / stored).is_file() or not (home / array).is_file():
                found.append(f"sample {sha[:12]}: a row without its files")
        model = json.loads(db.execute("SELECT value FROM meta WHERE key = 'model'").fetchone()[0])
        repo = home / "models" / model
        rows = {v for (v,) in db.execute("SELECT version FROM model_versions WHERE model = ?",
                                         [model])}
        promoted = {after: sid for sid, after in db.execute(
            "SELECT id, model_version_after FROM sessions WHERE state = 'done' AND "
            "outcome = 'promoted'")}
        running = {f"session-{sid}" for (sid,) in db.execute(
            "SELECT id FROM sessions WHERE state = 'running'")}
    finally:
        db.close()
    text = (repo / "current").read_text().strip()
    version = int(text[1:]) if text[:1] == "v" and text[1:].isdigit() else None
    manifest_path = repo / f"v{version}" / "manifest.json"
    if version is None or not manifest_path.is_file():
        found.append(f"current {text!r}: not a complete version")
    else:
        manifest = json.loads(manifest_path.read_text())
        if sha256(repo / f"v{version}" / "weights.npz") != manifest["sha256"]:
            found.append(f"current v{version}: weights do not match the manifest")
        session = manifest.get("session_id")
        if recovered and session is not None and promoted.get(version) != session:
            found.append(f"current v{version}: session {session}'s promotion is not in the "
                         "database (its samples would train twice)")
    if recovered:
        on_disk = {str(p.relative_to(home)) for p in (home / "samples").rglob("*") if p.is_file()}
        found += [f"sample file without a row: {p}" for p in sorted(on_disk - named)]
        for entry in repo.iterdir():
            if entry.name.startswith(".") or entry.name.startswith("v") and \
                    entry.name[1:].isdigit() and int(entry.name[1:]) not in rows:
                found.append(f"models/{model}/{entry.name}: left behind")
        for folder in (home / "runs").iterdir():
            if folder.name.startswith("session-") and folder.name not in running:
                found += [f"runs/{folder.name}/{p.name}: left behind" for p in folder.iterdir()
                          if p.suffix == ".npz" or p.name.startswith(".")]
    return found


# -- a run under the injector -----------------------------------------------------------------

@dataclass
class Run:
    """One run of an operation: how it was stopped, and what it left."""

    operation: str
    how: str  # "kill@N", "enospc@N", "eio@N", "kill-after-Ss", "kill-after-write-N+Dms", "count"
    returncode: int
    traceback: bool
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0  # the whole run: copy, operation, checks, recovery
    operation_s: float = 0.0  # the operation alone, until it ended or was stopped


Runner = Callable[[list[str], dict, float], subprocess.CompletedProcess]


def fresh_runner(args: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` in a fresh process (the benchmark; tests fork from a server)."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=timeout_s)


class Scenario:
    """A home made once, copied for each run, and one operation on it.

    Args:
        template: an initialised home (``make_template``).
        work: where each run's copy goes.
        runner: how a Python command line is run.
    """

    def __init__(self, template: Path, work: Path, runner: Runner = fresh_runner) -> None:
        self.template, self.work, self.runner = template, work, runner

    def fresh(self) -> tuple[Path, Path]:
        root = self.work / "run"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(self.template, root, symlinks=True)
        return root, root / "home"

    def command(self, operation: str, root: Path, home: Path, export_to: str = ".npz"
                ) -> tuple[list[str], Optional[Path]]:
        """The operation's command line (``-m MODULE ARGS``) and its stdin file.

        An export writes ``export_to``: ``.npz`` (odtd's weights, copied) or ``.keras`` (a
        worker builds the model and writes it).
        """
        if operation == "ingest":
            files = [[str(p), p.parent.name] for p in sorted((home / "inbox").rglob("*"))
                     if p.is_file()]
            stdin = root / "inbox.json"
            stdin.write_text(json.dumps(files))
            return ["-m", "odtd.daemon.tasks", "ingest", "--home", str(home)], stdin
        if operation in ("session", "promotion"):
            return ["-m", "odtd.cli", "--home", str(home), "train-now", "--foreground"], None
        out = root / "exports" / f"model{export_to}"
        return ["-m", "odtd.cli", "--home", str(home), "models", "export", "1", "--out",
                str(out)], None

    def run(self, operation: str, *, at: Optional[int] = None, fail: Optional[str] = None,
            kill_after_s: Optional[float] = None, count: bool = False, export_to: str = ".npz"
            ) -> tuple[Run, dict]:
        """Run ``operation`` once under the injector, check, recover, check.

        Returns:
            The run, and with ``count`` its writes: ``{"writes": N, "failable": M}``.
        """
        started = time.monotonic()
        root, home = self.fresh()
        before = self._state(home)
        command, stdin = self.command(operation, root, home, export_to)
        inject_args = ["--root", str(root)]
        if at is not None:
            inject_args += ["--at", str(at)] + (["--fail", fail] if fail else [])
        if kill_after_s is not None:
            inject_args += ["--kill-after-s", f"{kill_after_s:.4f}"]
        counter = root / "writes"
        if count:
            inject_args += ["--count", str(counter)]
        if operation == "promotion":
            inject_args += ["--within", "promotion"]
        if stdin is not None:
            inject_args += ["--stdin", str(stdin)]
        env = dict(os.environ, ODTD_HOME=str(home))
        operation_started = time.monotonic()
        done = self.runner([str(INJECTOR), *inject_args, "--", *command], env, 600)
        operation_s = time.monotonic() - operation_started
        how = "count" if count else f"{fail or 'kill'}@{at}" if at is not None else \
            f"kill-after-{kill_after_s:.3f}s"
        if at is not None and kill_after_s is not None:
            how = f"kill-after-write-{at}+{kill_after_s * 1000:.1f}ms"
        if operation == "export":
            how += f" ({export_to})"
        result = Run(operation, how, done.returncode, "Traceback" in done.stderr)
        if result.traceback and count:
            result.violations.append(f"traceback: {done.stderr[-400:]}")
        if fail is not None and result.traceback:
            result.violations.append(f"a traceback, not one Error: line: {done.stderr[-300:]}")
        result.violations += [f"at the kill: {v}" for v in check_home(home, recovered=False)]
        self._recover(operation, root, home, export_to)
        result.violations += [f"after recovery: {v}" for v in check_home(home, recovered=True)]
        result.violations += self._kept(operation, root, home, before, export_to)
        result.seconds = round(time.monotonic() - started, 2)
        result.operation_s = round(operation_s, 2)
        writes = json.loads(counter.read_text()) if count and counter.exists() else {}
        return result, writes

    def _state(self, home: Path) -> dict:
        db = sqlite3.connect(home / "odtd.db")
        try:
            pending = {sha for (sha,) in db.execute(
                "SELECT sha256 FROM samples WHERE status = 'pending'")}
        finally:
            db.close()
        inputs = {sha256(p) for p in (home / "inbox").rglob("*") if p.is_file()}
        return {"pending": pending, "inputs": inputs,
                "current": (home / "models/tinycnn/current").read_text()}

    def _recover(self, operation: str, root: Path, home: Path, export_to: str) -> None:
        """What odtd does next: the inbox scanned again; a session's recovery; the export again."""
        env = dict(os.environ, ODTD_HOME=str(home))
        if operation in ("session", "promotion"):
            self.runner(["-m", "odtd.daemon.tasks", "recover", "--home", str(home)], env, 120)
            return
        command, stdin = self.command(operation, root, home, export_to)
        if stdin is not None:
            command = [str(INJECTOR), "--root", str(root), "--stdin", str(stdin), "--", *command]
        self.runner(command, env, 600)

    def _kept(self, operation: str, root: Path, home: Path, before: dict, export_to: str
              ) -> list[str]:
        """The operation's own invariants, after recovery: nothing lost, nothing twice."""
        found = []
        db = sqlite3.connect(home / "odtd.db")
        try:
            status = dict(db.execute("SELECT sha256, status FROM samples").fetchall())
            trained_by = dict(db.execute(
                "SELECT s.sha256, x.outcome FROM samples s JOIN sessions x ON x.id = s.session_id "
                "WHERE s.status = 'trained'").fetchall())
        finally:
            db.close()
        if operation == "ingest":
            lost = [sha for sha in before["inputs"] if sha not in status
                    and not _quarantined(home, sha)]
            found += [f"input {sha[:12]} lost" for sha in lost]
            left = [p for p in (home / "inbox").rglob("*") if p.is_file()]
            found += [f"{p} still in the inbox after the ingest finished" for p in left]
        elif operation in ("session", "promotion"):
            for sha in before["pending"]:
                if sha not in status:
                    found.append(f"pending sample {sha[:12]} lost")
                elif status[sha] == "trained" and trained_by.get(sha) not in ("promoted",
                                                                              "rolled_back"):
                    found.append(f"sample {sha[:12]} marked trained by an unfinished session")
        else:
            out = root / "exports" / f"model{export_to}"
            if not out.exists():
                found.append("the export finished without its file")
            else:
                with zipfile.ZipFile(out) as archive:
                    if archive.testzip() is not None:
                        found.append("the export is damaged")
            found += [f"{p.name} left beside the export" for p in out.parent.iterdir()
                      if p.name != out.name]
        return found


def _quarantined(home: Path, sha: str) -> bool:
    return any(sha256(p) == sha for p in (home / "quarantine").glob("*")
               if not p.name.endswith(".reason.txt"))


# -- the home every run starts from --------------------------------------------------------------

def make_template(root: Path, odtctl: Callable[..., subprocess.CompletedProcess],
                  write_images: Callable[..., list]) -> Path:
    """An initialised tinycnn home that went through one session (v0 -> v1), with pending
    samples, a fresh day's images in its inbox and a bad file among them; ``keep_versions: 2``,
    so the next promotion prunes v0. ``root/home``; returns ``root``."""
    home = root / "home"
    odtctl("init", "--model", "tinycnn", home=home)
    policy = (REPO / "policies" / "tinycnn-test.yaml").read_text().replace("epochs: 2", "epochs: 1")
    (home / "policy.yaml").write_text(policy + "models:\n  keep_versions: 2\n")
    (home / "odtd.yaml").write_text("storage:\n  min_free_mb: 1\n")
    write_images(root / "day1", per_class=2, seed=1)
    odtctl("ingest", str(root / "day1"), home=home)
    odtctl("train-now", "--foreground", home=home)
    write_images(root / "day2", per_class=2, seed=2)
    odtctl("ingest", str(root / "day2"), home=home)
    write_images(home / "inbox", per_class=1, seed=3)
    (home / "inbox" / "cat" / "broken.jpg").write_bytes(b"not an image")
    for scratch in ("day1", "day2"):
        shutil.rmtree(root / scratch)
    return root


def spread(count: int, share: int) -> list[int]:
    """``share`` of the points 1..``count``, evenly spaced, first and last included."""
    if share >= count:
        return list(range(1, count + 1))
    if share == 1:
        return [1 + count // 2]
    return sorted({1 + round(i * (count - 1) / (share - 1)) for i in range(share)})


def kill_points(scenario: Scenario, operation: str, budget: int, seed: int = 0,
                modes: tuple = ("kill", "enospc", "eio"), on_run: Optional[Callable] = None
                ) -> dict:
    """Run ``operation`` at every write point in each of ``modes`` (as many as ``budget``
    allows), then at random moments up to ``budget`` kill points in all; return the counts.

    An export goes through both formats: ``.npz`` and ``.keras`` (a worker writes it), each at
    its write points, and ``.keras`` at the random moments (most of its time is the worker's).
    """
    formats = (".npz", ".keras") if operation == "export" else (".npz",)
    rng = random.Random(seed)
    runs, plan, durations, writes = [], [], {}, {}
    for export_to in formats:
        counted, writes[export_to] = scenario.run(operation, count=True, export_to=export_to)
        runs.append(counted)
        durations[export_to] = counted.operation_s
    # Three quarters of the budget at write points, shared out evenly by mode and format, each
    # share spread evenly over the writes (every write when the share allows); a quarter at
    # random moments.
    share = max(1, budget * 3 // 4 // (len(modes) * len(formats)))
    for mode in modes:
        for export_to in formats:  # a kill at any write; a failure at those a disk can fail
            points = writes[export_to]["writes" if mode == "kill" else "failable"]
            plan += [(mode, at, export_to) for at in spread(points, share)]
    for mode, at, export_to in plan:
        run, _ = scenario.run(operation, at=at, fail=None if mode == "kill" else mode,
                              export_to=export_to)
        runs.append(run)
        if on_run:
            on_run(run)
    while len(runs) - len(formats) < budget:  # the counting runs are no kill points
        export_to = formats[-1]
        if operation == "promotion":  # its moments inside it: after a random write, 0-10 ms on
            run, _ = scenario.run(operation, at=rng.randint(1, writes[export_to]["writes"]),
                                  kill_after_s=rng.uniform(0.0001, 0.01))
        else:
            run, _ = scenario.run(operation, kill_after_s=rng.uniform(0.05, durations[export_to]),
                                  export_to=export_to)
        runs.append(run)
        if on_run:
            on_run(run)
    violations = [{"run": r.how, "violation": v} for r in runs for v in r.violations]
    if operation != "export":  # one format: the counts themselves
        writes, durations = writes[".npz"], durations[".npz"]
    return {"operation": operation, "write_points": writes, "runs": len(runs),
            "kills_at_writes": sum(r.how.startswith("kill@") for r in runs),
            "failures_at_writes": sum(r.how.startswith(("enospc@", "eio@")) for r in runs),
            "kills_at_random_moments": sum(r.how.startswith("kill-after") for r in runs),
            # of those, the ones that stopped it before it ended (fresh processes: -SIGKILL)
            "random_kills_that_stopped_it": sum(r.how.startswith("kill-after") and
                                                r.returncode == -signal.SIGKILL for r in runs),
            "operation_s": durations, "violations": violations}
