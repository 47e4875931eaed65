"""``odtctl doctor``: run the trainer worker's interpreter once and say what it has.

The worker may run under another Python than the daemon's (``trainer.python``: JetPack 4.6's
Python 3.6 with NVIDIA's TensorFlow beside a Python 3.8 daemon). This starts that interpreter as
a worker is started (``odtd.trainer.protocol.launch.module_command``) with ``odtd.trainer.worker.stack``, and
prints one line per part (Python, odtd, numpy, TensorFlow, Keras, GPU, the worker's modules),
with the fix where one is missing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path
from typing import Any, Optional

from odtd.cli.output import command, emit, home_of, progress
from odtd.errors import ConfigError
from odtd.table import table

# The oldest of each the worker is tested on (`make test-tx2`): Python 3.6 with TensorFlow 2.6.
MIN_PYTHON = (3, 6)
MIN_TENSORFLOW = (2, 6)
CHECK_TIMEOUT_S = 300.0  # TensorFlow's import on a TX2's SD card is slow the first time


def _version(text: Optional[str]) -> tuple[int, ...]:
    parts = []
    for part in (text or "").split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def run_stack(argv: list[str], timeout_s: float = CHECK_TIMEOUT_S) -> tuple[Optional[dict], str]:
    """Run ``odtd.trainer.worker.stack`` with ``argv`` (its command); (what it printed, or None; why not).

    The second item is empty when the first is not None.
    """
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return None, f"{argv[0]}: no such file"
    except PermissionError:
        return None, f"{argv[0]}: not executable"
    except subprocess.TimeoutExpired:
        return None, f"{argv[0]} did not answer within {timeout_s:.0f} s"
    for line in reversed(proc.stdout.splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        if isinstance(found, dict) and "python" in found:
            return found, ""
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return None, f"{argv[0]} exited {proc.returncode}: {lines[-1] if lines else 'no output'}"


def check_lines(found: dict[str, Any], daemon_odtd: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The doctor's lines, (part, what was found), and the problems that stop a worker.

    Args:
        found: What ``odtd.trainer.worker.stack`` printed.
        daemon_odtd: The directory of this process's odtd package.
    """
    python = found["executable"]
    lines: list[tuple[str, str]] = []
    problems: list[str] = []

    def problem(part: str, text: str, fix: str) -> None:
        lines.append((part, f"{text}; fix: {fix}"))
        problems.append(f"{part} {text}")

    if _version(found["python"]) < MIN_PYTHON:
        problem("python", f"{found['python']} (the worker needs >= 3.6)",
                "set trainer.python in odtd.yaml to a Python >= 3.6 with TensorFlow")
    else:
        lines.append(("python", f"{found['python']} ({python})"))
    same = "the daemon's" if found["odtd_path"] == daemon_odtd else f"the daemon's is {daemon_odtd}"
    lines.append(("odtd", f"{found['odtd']} from {found['odtd_path']} ({same})"))
    if found["numpy_error"]:
        problem("numpy", f"missing ({found['numpy_error']})", f"{python} -m pip install numpy")
        return lines, problems  # TensorFlow and the worker were not tried without it
    lines.append(("numpy", found["numpy"]))
    if found["tensorflow_error"]:
        problem("tensorflow", f"missing ({found['tensorflow_error']})",
                f"install TensorFlow >= 2.6 into {python} (on a Jetson: NVIDIA's wheel for its "
                "JetPack, docs/jetson.md; elsewhere: pip install tensorflow)")
        return lines, problems
    if _version(found["tensorflow"]) < MIN_TENSORFLOW:
        problem("tensorflow", f"{found['tensorflow']} (the worker needs >= 2.6)",
                f"install TensorFlow >= 2.6 into {python}")
    else:
        lines.append(("tensorflow", found["tensorflow"]))
    dialect = "Keras 3" if (found["keras"] or "").startswith("3.") else "tf.keras 2"
    lines.append(("keras", f"{found['keras']} ({dialect})"))
    lines.append(_gpu_line(found))
    if found["worker_error"]:
        problem("worker", f"does not import: {found['worker_error']}",
                "a worker needs Python >= 3.6 with TensorFlow >= 2.6; report this line as a bug "
                "if it has both")
    else:
        lines.append(("worker", "its modules import"))
    return lines, problems


def _gpu_line(found: dict[str, Any]) -> tuple[str, str]:
    if found["gpus"]:
        return "gpu", ", ".join(found["gpus"])
    if found["jetson"]:
        why = ("this TensorFlow is built without CUDA: install NVIDIA's wheel for this JetPack"
               if not found["cuda_build"] else
               "a Jetson's GPU needs the user in group video (/dev/nvhost-*, /dev/nvmap)")
        return "gpu", f"none: training runs on the CPU; fix: {why} (docs/jetson.md)"
    return "gpu", "none: training runs on the CPU"


@command("doctor")
def cmd_doctor(args: argparse.Namespace) -> int:
    """Run the worker's interpreter once and print what it has, one line per part."""
    import odtd
    from odtd.config import TrainerConfig

    home = home_of(args)
    if args.python:
        trainer, origin = TrainerConfig(python=args.python), "--python"
    else:
        trainer = home.load_config().trainer
        origin = (f"trainer.python in {home.config_path}" if trainer.python else
                  f"the daemon's own; trainer.python is not set in {home.config_path}")
    argv = trainer.command("odtd.trainer.worker.stack")
    progress(f"starting {argv[0]} (imports TensorFlow) ...")
    found, failure = run_stack(argv)
    if found is None:
        emit(args, {"interpreter": argv[0], "origin": origin, "ok": False, "problems": [failure]},
             f"{'interpreter':<11} {argv[0]} ({origin})")
        raise ConfigError(f"the worker's interpreter does not run odtd: {failure}. Set "
                          f"trainer.python in {home.config_path} to a Python >= 3.6 with "
                          "TensorFlow, or check it with `odtctl doctor --python PATH`")
    lines, problems = check_lines(found, str(Path(odtd.__file__).resolve().parent))
    text = "\n".join(table([("interpreter", f"{argv[0]} ({origin})"), *lines], gap=" "))
    emit(args, {**found, "interpreter": argv[0], "origin": origin, "ok": not problems,
                "problems": problems}, text)
    if problems:
        raise ConfigError(f"the worker cannot run under {argv[0]}: {'; '.join(problems)}")
    return 0


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser,
                reader: argparse.ArgumentParser) -> None:
    """Add the doctor sub-command."""
    p = sub.add_parser("doctor", parents=[reader], help="check the trainer worker's interpreter",
                       description="Start the trainer worker's interpreter (trainer.python in "
                                   "odtd.yaml, else the daemon's own) as a worker is started and "
                                   "print its Python, odtd, numpy, TensorFlow and Keras versions, "
                                   "its GPUs and whether the worker's modules import, one line "
                                   "each, with the fix where one is missing. Exit status 1 if a "
                                   "worker cannot run there.")
    p.add_argument("--python", metavar="PATH",
                   help="check this interpreter instead of trainer.python (before setting it)")
