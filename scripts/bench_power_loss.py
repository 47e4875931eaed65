"""Power loss at any point: at least 200 kill points per operation, and the invariants after each.

Ingest (the daemon's inbox task), a session (``odtctl train-now --foreground`` and its worker),
the promotion (the writes inside ``Promotion.conclude``) and an export (``.npz`` and ``.keras``)
run on a copy of one home under scripts/fault_inject.py: SIGKILLed at each write (a
power cut stops the process there), failed at each write with ENOSPC and EIO (a full or
failing disk), and SIGKILLed at random moments. After each run: SQLite's integrity check,
every sample row with its files, ``current`` naming a complete version; then odtd's own
recovery and, again, those and no orphan file, no pending sample lost or trained twice, no
input lost, a finished export whole. Prints JSON: the counts per operation and every violation.

    python scripts/bench_power_loss.py [--runs 200] [--operations ingest,session,...] [--json]

A worker server (odtd/trainer/worker/forkserver.py) runs the sessions' workers: TensorFlow is
imported once, not at each of the hundreds of sessions. Takes about 40 minutes on the
development machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
import power_loss  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def odtctl(*args: str, home: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "odtd.cli", *args], capture_output=True,
                          text=True, env=dict(os.environ, ODTD_HOME=str(home)), cwd=REPO)
    if done.returncode:
        raise SystemExit(f"odtctl {' '.join(args)}: {done.stderr}")
    return done


def write_images(root: Path, per_class: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for label in CLASSES:
        (root / label).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                root / label / f"{i}.png")


def worker_server(directory: Path) -> subprocess.Popen:
    """Start odtd's worker server; return it once it listens."""
    sock = directory / "worker.sock"
    log = open(directory / "worker-server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "odtd.trainer.worker.forkserver", str(sock)],
                              stderr=log, stdout=subprocess.DEVNULL, cwd=REPO)
    deadline = time.monotonic() + 300
    while not sock.exists() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    os.environ["ODTD_WORKER_SERVER"] = str(sock)
    return server


def machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="kill points per operation")
    parser.add_argument("--operations", default=",".join(power_loss.OPERATIONS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="JSON only (no progress on stderr)")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench_power_loss-") as tmp:
        directory = Path(tmp)
        server = worker_server(directory)
        try:
            template = power_loss.make_template(
                directory / "template", odtctl,
                lambda root, per_class, seed: write_images(root, per_class, seed))
            scenario = power_loss.Scenario(template, directory / "work")
            (directory / "work").mkdir()
            results = []
            for operation in args.operations.split(","):
                started = time.monotonic()

                def show(run: power_loss.Run, operation: str = operation) -> None:
                    if not args.json:
                        print(f"{operation} {run.how}: exit {run.returncode}, "
                              f"{len(run.violations)} violations", file=sys.stderr)

                result = power_loss.kill_points(scenario, operation, args.runs, args.seed,
                                                on_run=show)
                result["wall_s"] = round(time.monotonic() - started, 1)
                results.append(result)
        finally:
            server.terminate()
            server.wait(timeout=60)
    print(json.dumps({"benchmark": "power_loss", "commit": commit, "machine": machine(),
                      "cpus": os.cpu_count(), "python": platform.python_version(),
                      "operations": results,
                      "violations": sum(len(r["violations"]) for r in results)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
