#!/usr/bin/env python3
"""Users' models on the defaults: does each learn on a new camera from the first night?

For each model of the zoo (tests/make_keras_models.py ``--zoo``: the Keras tutorial's residual
SeparableConv model, a Sequential CNN with Dropout and softmax, MobileNetV3Small with its own
preprocessing, EfficientNetB0, a transfer-learning model with a frozen base), trained with Adam
on the toy task's server images (the built-in synthetic shapes, or CIFAR-10 with ``--cifar``),
as a user would do it through the real CLI:

1. ``odtctl init --model-file M.keras --validation V --replay R``: V is the device's camera
   (``--shift``, dusk by default), R the server's training images;
2. each day ``odtctl ingest`` 64 new images of the device's camera (``--per-day``) and
   ``odtctl train-now --foreground``, for ``--days`` days.

Each recipe runs on a copy of one home per model, on the same images: ``defaults`` is the
policy ``init`` installed; every other is a policy file (``--recipe NAME=FILE``, repeatable)
or one of the hand-picked recipes below, copied over the home's policy after init. Prints the
table, or with ``--json`` ``{"machine", "commit", "settings", "models": {model: {"day0",
"recipes": {recipe: {"sessions": [{outcome, reason, accuracy_before, accuracy_after,
learning_rate, ...}], "gain", "first_promotion"}}, "best_recipe", "defaults_share_of_best"}}}``.

    python scripts/bench_zoo.py --json                       # the full sizes (96x96), slow
    python scripts/bench_zoo.py --size 32 --images 600 --epochs 3 --width 0.25 --models \
        tutorial_residual,sequential_dropout
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from odtd.profiling.sweep import cpu_description  # noqa: E402
from odtd.sim.datasets import synthetic, write_image_folder  # noqa: E402
from odtd.sim.shifts import get_shift  # noqa: E402

ZOO = ("tutorial_residual", "sequential_dropout", "mobilenet_v3_small", "efficientnet_b0",
       "transfer_frozen_base")
CLASSES = ("c0", "c1", "c2", "c3", "c4")
ODTCTL = [sys.executable, "-m", "odtd.cli"]

# Hand-picked recipes to compare the defaults with: each a policy, as a user could write it.
HAND_PICKED = {
    "new-camera": (REPO / "policies" / "new-camera.yaml").read_text(),
    "builtin-default": (REPO / "policies" / "default.yaml").read_text(),
    "adam-low-lr": """
batch: {size: 32}
training: {epochs: 2, optimizer: adam, learning_rate: 0.0001, freeze_bn: false,
           bn_device_share: 0.75, clip_norm: 1.0}
replay: {ratio: 1.0, max_samples: 192, device_share: 0.5}
acceptance: {tolerance: 0.0, confidence_z: 1.0, reference_tolerance: 1.0}
""",
    "sgd-clipped-3-epochs": """
batch: {size: 16}
training: {epochs: 3, optimizer: sgd, learning_rate: 0.005, momentum: 0.9, freeze_bn: false,
           bn_device_share: 0.75, clip_norm: 1.0, trained_share: auto}
replay: {ratio: 1.0, max_samples: 192, device_share: 0.5}
acceptance: {tolerance: 0.0, confidence_z: 1.0, reference_tolerance: 1.0}
""",
}


def say(message):
    print(message, file=sys.stderr, flush=True)


def odtctl(home, *args):
    proc = subprocess.run(ODTCTL + ["--home", str(home)] + list(args), capture_output=True,
                          text=True, cwd=str(REPO))
    if proc.returncode != 0:
        raise SystemExit("odtctl {} failed: {}".format(" ".join(args), proc.stderr.strip()[-2000:]))
    return proc


def server_and_device_images(args):
    """(replay x, y), (validation x, y), [(day x, y)]: server images and the device's camera."""
    count = args.replay + args.validation + args.days * args.per_day
    if args.cifar:
        from odtd.sim.datasets import open_dataset

        data = open_dataset(args.cifar)
        # Positions in the split (load_arrays' indices) of the images of the first five classes.
        positions = [i for i, (_, label) in enumerate(data.files("train")) if label < len(CLASSES)]
        rng = np.random.default_rng(args.seed + 100)
        picked = rng.permutation(len(positions))[:count]
        x, y = data.load_arrays("train", [positions[i] for i in picked])
    else:
        x, y = synthetic(count * 2 + 20, "server", args.seed + 100)
        keep = y < len(CLASSES)
        x, y = x[keep][:count], y[keep][:count]
    if args.size != x.shape[1]:
        from PIL import Image

        x = np.stack([np.asarray(Image.fromarray(image).resize((args.size, args.size),
                                                                Image.BILINEAR)) for image in x])
    shift = get_shift(args.shift)
    replay = (x[:args.replay], y[:args.replay])
    rest_x, rest_y = x[args.replay:], y[args.replay:]
    camera = shift(rest_x, seed=args.seed)
    validation = (camera[:args.validation], rest_y[:args.validation])
    days = []
    for day in range(args.days):
        begin = args.validation + day * args.per_day
        days.append((camera[begin:begin + args.per_day], rest_y[begin:begin + args.per_day]))
    return replay, validation, days


def train_models(args, out):
    """The zoo's files, trained by tests/make_keras_models.py (cached in ``out``)."""
    wanted = [name for name in args.models if not (out / (name + ".keras")).exists()]
    if wanted:
        say("training the zoo on the server's images: {}".format(", ".join(wanted)))
        cmd = [sys.executable, str(REPO / "tests" / "make_keras_models.py"), str(out), "--zoo",
               str(args.size), str(args.images), str(args.epochs), str(args.width)] + wanted
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
        if proc.returncode != 0:
            raise SystemExit("make_keras_models.py failed: " + proc.stderr[-3000:])
        described = json.loads(proc.stdout.splitlines()[-1])
        info_path = out / "zoo.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        info.update(described)
        info_path.write_text(json.dumps(info))
    return json.loads((out / "zoo.json").read_text())


def run_recipe(template, home, policy_text, days):
    """Copy the template home, install the recipe, live the days; return the sessions."""
    if home.exists():
        shutil.rmtree(home)
    shutil.copytree(template, home, symlinks=True)
    if policy_text is not None:
        (home / "policy.yaml").write_text(policy_text)
    sessions = []
    for day, folder in enumerate(days, start=1):
        odtctl(home, "ingest", str(folder), "--day", f"2026-01-{day:02d}")
        started = time.monotonic()
        proc = odtctl(home, "train-now", "--foreground", "--force", "--json")
        record = json.loads(proc.stdout)
        details = record.get("details") or {}
        sessions.append({key: record.get(key) for key in (
            "outcome", "reason", "accuracy_before", "accuracy_after", "energy_j", "duration_s",
            "peak_memory_mb")})
        sessions[-1].update(learning_rate=details.get("learning_rate"),
                            lr_attempts=details.get("lr_attempts"),
                            wall_s=round(time.monotonic() - started, 1))
        say("  day {}: {} {} -> {} ({})".format(day, record.get("outcome"),
                                                record.get("accuracy_before"),
                                                record.get("accuracy_after"), record.get("reason")))
    return sessions


def summarise(sessions, day0):
    """The served model's gain over day 0 after the sessions, and the first promoted session."""
    served = day0
    first = None
    for index, session in enumerate(sessions, start=1):
        if session["outcome"] == "promoted":
            served = session["accuracy_after"]
            first = first or index
    return {"gain": None if served is None or day0 is None else round(served - day0, 4),
            "first_promotion": first}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo models")
    parser.add_argument("--size", type=int, default=96, help="input size in pixels (square)")
    parser.add_argument("--images", type=int, default=2000, help="server training images")
    parser.add_argument("--epochs", type=int, default=6, help="the server's Adam epochs")
    parser.add_argument("--width", type=float, default=1.0,
                        help="channel width of the tutorial and Sequential models")
    parser.add_argument("--replay", type=int, default=1000, help="server images as --replay")
    parser.add_argument("--validation", type=int, default=300,
                        help="the device camera's images as --validation")
    parser.add_argument("--days", type=int, default=2)
    parser.add_argument("--per-day", type=int, default=64)
    parser.add_argument("--shift", default="dusk", help="the device's camera (odtctl simulate "
                        "--shift help lists them)")
    parser.add_argument("--cifar", help="CIFAR-10 JPEG archive or folder instead of the built-in "
                        "synthetic images (its first five classes)")
    parser.add_argument("--recipes", default="defaults," + ",".join(HAND_PICKED),
                        help="defaults (what init installs), hand-picked names ({}), or "
                        "NAME=POLICY.yaml".format(", ".join(HAND_PICKED)))
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "odtd" / "zoo"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.models = [name for name in args.models.split(",") if name]
    recipes = {}
    for item in args.recipes.split(","):
        name, _, path = item.partition("=")
        recipes[name] = None if name == "defaults" else (
            Path(path).read_text() if path else HAND_PICKED[name])
    key = "s{}-i{}-e{}-w{}-{}".format(args.size, args.images, args.epochs, args.width,
                                      "cifar" if args.cifar else "synthetic")
    work = Path(args.work) / key
    models_dir = work / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    zoo = train_models(args, models_dir)
    replay, validation, days = server_and_device_images(args)
    data = work / f"data-{args.shift}-{args.seed}"
    if not data.exists():
        staging = data.with_suffix(".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        write_image_folder(*replay, CLASSES, staging / "replay")
        write_image_folder(*validation, CLASSES, staging / "validation")
        for day, images in enumerate(days, start=1):
            write_image_folder(*images, CLASSES, staging / f"day{day}")
        staging.rename(data)
    day_folders = [data / f"day{day}" for day in range(1, args.days + 1)]
    results = {}
    for name in args.models:
        say(f"{name}: init")
        template = work / "homes" / name / "template"
        shutil.rmtree(template, ignore_errors=True)
        template.parent.mkdir(parents=True, exist_ok=True)
        proc = odtctl(template, "init", "--model-file", str(models_dir / (name + ".keras")),
                      "--classes", ",".join(CLASSES), "--validation", str(data / "validation"),
                      "--replay", str(data / "replay"), "--json")
        init = json.loads(proc.stdout)
        entry = {"params": zoo[name]["params"], "server_train_accuracy": zoo[name]["train_accuracy"],
                 "init_policy": init.get("policy"), "policy_check": init.get("policy_check"),
                 "day0": None, "recipes": {}}
        for recipe, text in recipes.items():
            say(f"{name}: recipe {recipe}")
            sessions = run_recipe(template, work / "homes" / name / recipe, text, day_folders)
            entry["day0"] = entry["day0"] if entry["day0"] is not None else \
                sessions[0]["accuracy_before"]
            entry["recipes"][recipe] = dict(sessions=sessions, **summarise(sessions, entry["day0"]))
        others = {r: v["gain"] for r, v in entry["recipes"].items() if r != "defaults"
                  and v["gain"] is not None}
        if others:
            best = max(others, key=others.get)
            entry["best_recipe"] = best
            defaults = entry["recipes"].get("defaults", {}).get("gain")
            if defaults is not None and others[best] > 0:
                entry["defaults_share_of_best"] = round(defaults / others[best], 3)
        results[name] = entry
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=str(REPO)).stdout.strip()
    report = {"machine": cpu_description(), "commit": commit,
              "settings": {k: v for k, v in vars(args).items() if k != "json"},
              "models": results}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print("machine: {}, commit {}".format(report["machine"], commit))
    print("{:22s} {:>6s}  {:22s} {:>8s} {:>8s} {:>8s} {:>6s}".format(
        "model", "day 0", "recipe", "after 1", "after 2", "gain", "first"))
    for name, entry in results.items():
        for recipe, value in entry["recipes"].items():
            served, cells = entry["day0"], []
            for session in value["sessions"][:2]:
                if session["outcome"] == "promoted":
                    served = session["accuracy_after"]
                cells.append(f"{served:.1%}" if served is not None else "-")
            print("{:22s} {:>6s}  {:22s} {:>8s} {:>8s} {:>8s} {:>6s}".format(
                name, "{:.1%}".format(entry["day0"]) if entry["day0"] is not None else "-", recipe,
                *(cells + ["-"] * (2 - len(cells))),
                "{:+.1%}".format(value["gain"]) if value["gain"] is not None else "-",
                str(value["first_promotion"] or "-")))


if __name__ == "__main__":
    main()
