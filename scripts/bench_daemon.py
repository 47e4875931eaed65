#!/usr/bin/env python3
"""The daemon's memory: VmRSS idle, and after N sessions (which must not grow it). Prints JSON.

Runs a real `odtd run` on a fresh tinycnn home with the 10 ms sampler on, ingests 64 images per
session through the inbox, asks for sessions over the control socket, and reads
/proc/<pid>/status between them. ``--worker-python`` runs the workers under another interpreter
(``trainer.python``): a TX2's daemon on Python 3.8 beside its Python 3.6 worker, as
``make test-tx2`` builds them (``.venv-tx2-daemon/bin/python scripts/bench_daemon.py
--worker-python .venv-tx2-py36/bin/python``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from odtd.daemon.control import request
from odtd.trainer.protocol.procfs import read_proc_mb


def vm(pid: int, key: str) -> float:
    value = read_proc_mb(key, Path(f"/proc/{pid}/status"))
    if value is None:
        raise KeyError(key)
    return value


def wait(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError("condition not met")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker-python", help="trainer.python: the workers' interpreter")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_daemon-"))
    home = tmp / "home"
    env = dict(os.environ, ODTD_HOME=str(home))
    odtctl = [sys.executable, "-m", "odtd.cli"]
    trainer = (f"trainer:\n  python: {Path(args.worker_python).absolute()}\n"
               if args.worker_python else "")
    home.mkdir(parents=True)
    (home / "odtd.yaml").write_text(trainer)
    subprocess.run([*odtctl, "init", "--model", "tinycnn"], env=env, check=True, capture_output=True)
    (home / "odtd.yaml").write_text("inbox:\n  scan_interval_s: 1\n" + trainer)
    daemon = subprocess.Popen([sys.executable, "-m", "odtd.daemon.service", "run"], env=env,
                              stderr=subprocess.DEVNULL)
    sock = home / "run" / "odtd.sock"
    try:
        wait(sock.exists, 30)
        time.sleep(5)  # settle: imports done, sampler running
        idle = vm(daemon.pid, "VmRSS")
        after = []
        rng = np.random.default_rng(0)
        for session in range(args.sessions):
            for i in range(64):
                folder = home / "inbox" / ("cat" if i % 2 else "dog")
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                    folder / f"{session}-{i}.png")
            wait(lambda: not any(p.is_file() for p in (home / "inbox").rglob("*")), 30)
            result = request(sock, "train-now", {"wait": True}, timeout_s=None)
            time.sleep(2)
            after.append({"session": session + 1, "outcome": result.get("outcome"),
                          "vm_rss_mb": round(vm(daemon.pid, "VmRSS"), 1)})
        hwm = vm(daemon.pid, "VmHWM")
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"machine": f"{os.uname().machine}, {os.cpu_count()} CPUs", "python": sys.version.split()[0],
              "worker_python": args.worker_python,
              "idle_vm_rss_mb": round(idle, 1), "after_sessions": after, "vm_hwm_mb": round(hwm, 1),
              "growth_mb": round(after[-1]["vm_rss_mb"] - after[0]["vm_rss_mb"], 1),
              "target_idle_mb": 40}
    print(json.dumps(report, indent=2) if args.json else
          f"idle {report['idle_vm_rss_mb']} MB; after sessions "
          f"{[a['vm_rss_mb'] for a in after]} MB; peak {report['vm_hwm_mb']} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
