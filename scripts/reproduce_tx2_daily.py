#!/usr/bin/env python3
"""The published on-device scenario on CIFAR-10, odtd beside its controls: 64 new images a day.

Published (TX2, DenseNet40, plain fine-tuning): test accuracy 60.65% -> 61.32% over 17 days.

1. Pre-train the network (densenet40 by default) on part of the training set until a check set
   of other training images reaches --target (60%); cached under --work, so reruns skip it.
2. The arms (odtd/sim/arms.py; --arms, by default every one that applies) go from that base
   model through the same days, 64 unseen training images a day (the device's camera):
   (a) odtd: a real ODTD_HOME (the base model, --validation-images as its validation set, the
   pre-training images as its replay seed) and a session a day through odtd's Ingestor and
   SessionRunner, the recipe of --policy (policies/densenet40.yaml by default); (b) replay: the
   same sessions with nothing new (as many of the replay seed's own images as (a) trained on);
   (c) clean: the same sessions on (a)'s images as the original domain saw them (with --shift);
   (d) plain fine-tuning as published (SGD 0.005, momentum 0.9, batch 16, 3 epochs, no replay,
   no guard); (e) adabn: BatchNorm statistics re-estimated on the device's images so far, no
   training; (f) none: the base model; (g) priors: the base model with the device's class
   priors (EM); (h) tent: TENT, online; (i) labels: (a)'s recipe with its label-free options
   (prior_correction, pseudo_labels, bn_class_balanced) off, on (a)'s labelled images alone.
3. --shift NAME (odtd/sim/shifts.py): the device's camera differs: the day's images, (a)'s
   held-out share of them and the validation set are shifted; pre-training and replay never.
4. Scoring (odtd/sim/scoring.py): every arm's model, image by image, on a fixed class-balanced
   subset of the test set every day (--daily-test-images) and on all --test-images after the
   last day, shifted and clean; a model is scored once. (a) less each control, per day, with
   the standard error of the paired difference over the test images; joules per point gained
   on validation, cumulative, per arm. --seeds repeats the days with other draws and training
   seeds (the same base model and test images) and pools the last day.

Usage: scripts/reproduce_tx2_daily.py --cifar ../shared/datasets/cifar10-jpeg.tar.gz
       [--shift dusk] [--arms odtd,replay,clean] [--seeds 0,1,2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import date, timedelta
from pathlib import Path

import numpy as np
from reproduce_tx2_report import PUBLISHED, table

from odtd.config import TelemetryConfig
from odtd.errors import OdtdError
from odtd.home.create import InitRequest, init_home
from odtd.home.paths import Home
from odtd.home.spec import ModelSpec
from odtd.home.versions import ModelRepo
from odtd.policy import Policy, load_policy
from odtd.profiling.sweep import cpu_description
from odtd.report.plot import plot_arms
from odtd.sim import datasets
from odtd.sim.arms import (
    ARMS,
    SESSION_ARMS,
    Day,
    ReplayPool,
    SessionArm,
    Trial,
    buffered_images,
    labels_only,
    link_home,
    parse_arms,
)
from odtd.sim.controls import AdaBnArm, BaseArm, PlainArm, PriorArm, TentArm
from odtd.sim.scenario import Scenario, mixed_sample, stream_draws
from odtd.sim.scoring import RunLog, ScoringSets, combine_runs
from odtd.sim.shifts import get_shift
from odtd.telemetry.meter import SessionEnergyMeter, running_sampler

REPO = Path(__file__).resolve().parents[1]
START_DAY = date(2026, 1, 1)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def show_steps(message: dict) -> None:
    if message.get("event") == "step" and message["index"] % 100 == 0:
        log(f"  step {message['index']} loss {message['loss']:.3f}")


def pretrain(args, trial: Trial, ds, pretrain_idx, check_npz: Path) -> dict:
    """Train from scratch until the check set reaches the target; cached by its settings."""
    work = trial.work
    model = "" if trial.model == "densenet40" else f"{trial.model}-"  # earlier caches stay valid
    key = (f"base-{model}n{len(pretrain_idx)}-s{args.seed}-t{int(args.target * 100)}"
           f"-b{args.pretrain_batch}-lr{args.pretrain_lr:g}-d{args.pretrain_decay_epoch}"
           f"-{args.pretrain_anneal_epoch}")
    weights, meta = work / f"{key}.npz", work / f"{key}.json"
    if weights.exists() and meta.exists():
        log(f"pre-trained base model cached: {weights}")
        return json.loads(meta.read_text())
    started = time.monotonic()
    x, y = ds.load_arrays("train", pretrain_idx)
    data = work / "pretrain.npz"
    np.savez(data, x=x, y=y)
    # Resumable: each finished chunk of epochs is kept, so an interrupted run picks up there.
    progress_file, current = work / f"{key}.progress.json", work / f"{key}.partial.npz"
    if progress_file.exists() and current.exists():
        state = json.loads(progress_file.read_text())
        epochs, history, started = state["epochs"], state["history"], started - state["seconds"]
        log(f"resuming pre-training after {epochs} epochs")
    else:
        trial.run(trial.job("init", weights_out=str(current), seed=args.seed))
        epochs, history = 0, []
    while epochs < args.pretrain_max_epochs:
        # Step decay: a high rate to learn fast, a fifth of it to settle, a 25th to anneal.
        rate = args.pretrain_lr / (1 if epochs < args.pretrain_decay_epoch else
                                   5 if epochs < args.pretrain_anneal_epoch else 25)
        out = work / "pretrain-next.npz"
        result, _ = trial.run(trial.job(
            "train", weights_in=str(current), weights_out=str(out), train_data=str(data),
            validation_data=str(check_npz), batch_size=args.pretrain_batch,
            epochs=args.pretrain_chunk, optimizer="sgd", learning_rate=rate, momentum=0.9,
            augment=True, seed=args.seed + epochs, eval_batch_size=250), on_message=show_steps)
        shutil.move(out, current)
        epochs += args.pretrain_chunk
        history.append({"epochs": epochs, "check_accuracy": result["accuracy_after"], "lr": rate})
        progress_file.write_text(json.dumps({"epochs": epochs, "history": history,
                                             "seconds": round(time.monotonic() - started, 1)}))
        log(f"pre-training: {epochs} epochs, check-set accuracy {result['accuracy_after']:.2%}")
        if result["accuracy_after"] >= args.target:
            break
    shutil.copyfile(current, weights)
    seconds = round(time.monotonic() - started, 1)
    info = {"weights": str(weights), "images": len(pretrain_idx), "epochs": epochs,
            "history": history, "seconds": seconds}
    meta.write_text(json.dumps(info, indent=2))
    log(f"pre-trained in {seconds} s")
    return info


def odtd_policy(path: Path, precision: str, seed_offset: int = 0) -> Policy:
    """The policy file's recipe, with this machine's precision and the run's seed.

    Evaluation keeps the policy's batch size: batches of 250 were no faster here and left the
    worker's heap about 500 MB larger for the rest of the session (CHANGELOG.md, the memory
    runs of 2026-11-25).
    """
    policy = load_policy(path)
    training = policy.training.model_copy(update={
        "precision": precision, "seed": policy.training.seed + seed_offset})
    return policy.model_copy(update={"training": training})


def write_policy(home: Path, policy: Policy, source: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "policy.yaml").write_text(
        f"# written by reproduce_tx2_daily.py: {source} with precision and seed\n"
        + json.dumps(policy.model_dump(), indent=2))


def make_template(args, trial: Trial, ds, seed_names: list, validation, base_weights: Path,
                  policy: Policy) -> Path:
    """The home every session arm copies: the base model, its validation set and replay seed."""
    home = Home(trial.work / "home-template")
    # Written before init, which keeps an existing policy file: the replay capacity applies to
    # the seed as well.
    write_policy(home.root, policy, args.policy)
    seed_dir = trial.work / "replay-seed"
    shutil.rmtree(seed_dir, ignore_errors=True)
    ds.extract("train", seed_names, seed_dir)
    log(f"odtd home: base model, {len(validation[1])} validation images, {len(seed_names)} replay "
        "seed images")
    if args.import_model:  # as a user's Keras file, given to `odtctl init --model-file`
        model_file = trial.work / "base.keras"
        trial.run(trial.job("export", weights_in=str(base_weights), export_to=str(model_file)))
        log(f"base model exported to {model_file}, imported by init --model-file")
        init_home(home, InitRequest(None, list(datasets.CLASSES), model_file=model_file, force=True,
                                    validation_arrays=validation,
                                    replay=seed_dir if seed_names else None))
    else:
        init_home(home, InitRequest(trial.model, list(datasets.CLASSES), weights=base_weights,
                                    force=True, validation_arrays=validation,
                                    replay=seed_dir if seed_names else None))
    shutil.rmtree(seed_dir)
    return home.root


def run_imported(trial: Trial, template: Path) -> Path:
    """Make every arm run the template's imported model; return its version 0 weights."""
    home = Home(template)
    store = home.open_store()
    try:
        spec = ModelSpec.from_store(store)
    finally:
        store.close()
    trial.model, trial.model_keys = spec.name, spec.job_keys(home)
    return ModelRepo(home.models, spec.name).weights_path(0)


def run_seed(args, seed: int, arms: list, trial: Trial, data: dict, tests: ScoringSets, base: RunLog,
             template) -> RunLog:
    """The days of every arm with one seed (the draws, the sessions' and plain's training)."""
    ds, shift, train_files = data["ds"], data["shift"], data["train_files"]
    scenario = data["scenario"]
    if scenario.even:
        draws = [(day, None) for day in datasets.daily_draws(
            data["labels"], args.days, args.per_day, seed=seed + 2, exclude=data["used"])]
    else:  # the device's stream: its mix, its runs, its images without labels
        draws = stream_draws(data["labels"], args.days, args.per_day, scenario, seed + 2,
                             exclude=data["used"], mix_seed=args.seed)  # the tests' mix
    built = {}
    for arm in arms:
        if arm in SESSION_ARMS:
            home = link_home(template, trial.work / "homes" / f"s{seed}-{arm}")
            policy = odtd_policy(Path(args.policy), args.precision, seed - args.seed)
            write_policy(home.root, labels_only(policy) if arm == "labels" else policy, args.policy)
            pool = ReplayPool(ds, data["buffered_idx"], seed + 5) if arm == "replay" else None
            built[arm] = SessionArm(arm, trial, home, ds, pool)
        elif arm == "plain":
            built[arm] = PlainArm(trial, data["base_weights"], trial.work / f"plain-s{seed}.npz", seed)
        elif arm == "priors":
            built[arm] = PriorArm(trial, data["base_weights"], trial.work / f"priors-s{seed}",
                                  data["calibration"], data["validation"], data["batch_size"])
        elif arm == "tent":
            built[arm] = TentArm(trial, data["base_weights"], trial.work / f"tent-s{seed}.npz",
                                 data["batch_size"])
        elif arm == "adabn":
            built[arm] = AdaBnArm(trial, data["base_weights"], trial.work / f"adabn-s{seed}.npz",
                                  data["batch_size"])
        else:
            built[arm] = BaseArm(data["base_weights"])
    run = RunLog(seed, arms, base.base, tests.daily)
    day0 = run.rows[0]["arms"][arms[0]]  # every arm starts from the base model
    log(f"seed {seed} day 0: every arm {' / '.join(f'{100 * day0[d]:.2f}' for d in tests.domains)}"
        f" on the daily test images ({' / '.join(tests.domains)})")
    try:
        for number in range(1, args.days + 1):
            indices, unlabelled_idx = draws[number - 1]
            x, y = ds.load_arrays("train", indices)
            unlabelled = None
            if unlabelled_idx is not None and len(unlabelled_idx):
                unlabelled = ds.load_arrays("train", unlabelled_idx)[0]
                unlabelled = shift(unlabelled, seed=[seed, 200 + number]) if shift else unlabelled
            day = Day(number, (START_DAY + timedelta(days=number - 1)).isoformat(),
                      [train_files[i][0] for i in indices],
                      shift(x, seed=[seed, 100 + number]) if shift else x, y, shift is not None,
                      unlabelled=unlabelled)
            records = {}
            for arm in arms:
                records[arm] = built[arm].day(day)
            last = number == args.days
            scores = {arm: tests.score(records[arm]["weights"], full=last,
                                       validation=arm not in SESSION_ARMS) for arm in arms}
            row = run.day(number, records, scores)
            log(f"seed {seed} day {number}: " + ", ".join(
                f"{arm} {' / '.join(f'{100 * v[d]:.2f}' for d in tests.domains)}"
                + (f" ({v['outcome']})" if "outcome" in v else "") for arm, v in row["arms"].items()))
    finally:
        for arm in built.values():
            getattr(arm, "close", lambda: None)()
    return run


def scenario_tests(ds, test_labels: list, mix: np.ndarray, args) -> tuple:
    """Test images of the device's mix and as many evenly mixed ones; the daily subset.

    Returns ``({"device": x, "clean": x}, {"device": y, "clean": y}, daily indices)``: as many
    of each as the device's mix leaves of its largest class (at most --test-images), the daily
    subset the same positions in both.
    """
    device_idx = mixed_sample(test_labels, args.test_images, mix, args.seed + 4)
    per_class = min(len(device_idx), args.test_images) // len(datasets.CLASSES)
    clean_idx = datasets.take_per_class(test_labels, per_class, seed=args.seed + 5, exclude=device_idx)
    clean_idx = np.random.default_rng(args.seed + 5).permutation(clean_idx)
    count = min(len(device_idx), len(clean_idx))
    (dx, dy), (cx, cy) = (ds.load_arrays("test", idx[:count]) for idx in (device_idx, clean_idx))
    daily = np.sort(np.random.default_rng(args.seed + 3).permutation(count)[:args.daily_test_images])
    return {"device": dx, "clean": cx}, {"device": dy, "clean": cy}, daily


def run(args) -> dict:
    started = time.monotonic()
    shift = get_shift(args.shift) if args.shift else None
    scenario = Scenario.parse(args.priors, args.stream, args.unlabelled)
    arms = parse_arms(args.arms, shift is not None, scenario.priors is not None, not scenario.even)
    seeds = args.seeds or [args.seed]
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log(f"reading {args.cifar} ...")
    ds = datasets.open_dataset(Path(args.cifar))
    train_files = ds.files("train")
    labels = np.array([label for _, label in train_files])
    pretrain_idx = datasets.take_per_class(labels, args.pretrain_images // 10, seed=args.seed)
    seed_idx = pretrain_idx[:args.replay_seed]
    if "replay" in arms and len(seed_idx) < args.days * args.per_day * len(seeds):
        raise OdtdError(f"--arms replay lends each replay seed image once: {len(seed_idx)} replay seed "
                        f"images < {args.days} days x {args.per_day} x {len(seeds)} seeds; raise "
                        "--replay-seed or --pretrain-images")
    mix = scenario.mix(len(datasets.CLASSES), args.seed)
    check_idx = datasets.take_per_class(labels, args.validation_images // 10, seed=args.seed + 1,
                                        exclude=pretrain_idx) if scenario.priors is None else \
        mixed_sample(labels, args.validation_images, mix, args.seed + 1, exclude=pretrain_idx)
    test_labels = [label for _, label in ds.files("test")]
    if scenario.even:
        test_idx = (None if args.test_images >= len(test_labels) else datasets.take_per_class(
            test_labels, args.test_images // 10, seed=args.seed + 4))
        test_x, test_y = ds.load_arrays("test", test_idx)
        daily_idx = datasets.take_per_class(test_y, args.daily_test_images // 10, seed=args.seed + 3)
    else:  # the device's own mix, and evenly mixed clean images (the reference), as many of each
        test_x, test_y, daily_idx = scenario_tests(ds, test_labels, mix, args)
    log(f"test set: {len(daily_idx if scenario.even else test_y['device'])} images"
        + ("" if scenario.even else " of the device's mix and as many evenly mixed")
        + f", {len(daily_idx)} scored every day")
    check_x, check_y = ds.load_arrays("train", check_idx)
    np.savez(work / "check.npz", x=check_x, y=check_y)  # pre-training's, never shifted
    trial = Trial(args.model, list(datasets.CLASSES), [32, 32, 3], args.precision, work, log=log)
    base = pretrain(args, trial, ds, pretrain_idx, work / "check.npz")
    policy = odtd_policy(Path(args.policy), args.precision)
    # The device's validation set and test images: one shift for every run and arm.
    validation = (shift(check_x, seed=[args.seed, 1]) if shift else check_x, check_y)
    if scenario.even:
        images = {"shifted": shift(test_x, seed=[args.seed, 2]), "clean": test_x} if shift \
            else {"clean": test_x}
    else:  # "device": its mix through its camera; "clean": evenly mixed, unshifted
        images = {"device": shift(test_x["device"], seed=[args.seed, 2]) if shift else test_x["device"],
                  "clean": test_x["clean"]}
    tests = ScoringSets(trial, images, test_y, daily_idx, validation,
                        offset_domains=None if scenario.even else ("device", "validation"))
    data = {"ds": ds, "shift": shift, "train_files": train_files, "labels": labels,
            "used": np.concatenate([pretrain_idx, check_idx]), "base_weights": Path(base["weights"]),
            "batch_size": policy.batch.size, "scenario": scenario, "validation": validation}
    template = None
    if set(arms) & set(SESSION_ARMS) or args.import_model:
        template = make_template(args, trial, ds, [train_files[i][0] for i in seed_idx], validation,
                                 Path(base["weights"]), policy)
        buffered = buffered_images(Home(template))
        data["buffered_idx"] = np.array([i for i in seed_idx
                                         if train_files[i][0].split("/", 1)[1] in buffered], np.int64)
    if args.import_model:
        data["base_weights"] = run_imported(trial, template)
    if "priors" in arms:  # the priors arm's calibration: the home's reference set, else seed images
        reference = Home(template).reference_file() if template else None
        if reference is not None and reference.exists():
            with np.load(reference, allow_pickle=False) as arrays:
                data["calibration"] = (arrays["x"], arrays["y"].astype(np.int64))
        else:
            data["calibration"] = ds.load_arrays("train", seed_idx[:500])
    day0 = RunLog(args.seed, arms, tests.score(data["base_weights"], full=True, validation=True),
                  tests.daily)
    runs = []
    with running_sampler(TelemetryConfig(backend=args.telemetry)) as sampler:
        trial.meter = SessionEnergyMeter(sampler)
        for seed in seeds:
            runs.append(run_seed(args, seed, arms, trial, data, tests, day0, template))
    summary = {
        "machine": cpu_description(), "published": PUBLISHED, "days": args.days, "per_day": args.per_day,
        "model": args.model, "imported": args.import_model, "shift": args.shift, "arms": arms, "seeds": seeds,
        "arm_descriptions": {arm: ARMS[arm] for arm in arms},
        "test_images": {"all": tests.count, "daily": len(daily_idx), "domains": tests.domains},
        "scenario": scenario.describe(),
        "validation_images": len(check_y), "policy": args.policy,
        "acceptance": policy.acceptance.model_dump(), "replay_seed": len(seed_idx),
        "pretrain": {"images": base["images"], "epochs": base["epochs"], "seconds": base["seconds"],
                     "history": base["history"], "test_accuracy": day0.base.accuracy(),
                     "validation_accuracy": day0.base.validation},
        "runs": [run.report() for run in runs], "final": combine_runs(runs),
        "wall_s": round(time.monotonic() - started, 1),
    }
    if args.plot:
        summary["plot"] = str(plot_arms(summary, Path(args.plot)))
    return summary


def seed_list(text: str) -> list:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cifar", default=os.environ.get("ODTD_CIFAR10"),
                        help="CIFAR-10 JPEG tar.gz or folder (or $ODTD_CIFAR10)")
    parser.add_argument("--days", type=int, default=17)
    parser.add_argument("--per-day", type=int, default=64)
    parser.add_argument("--shift", metavar="NAME",
                        help="the device's camera: a camera shift ('--shift help' lists them), "
                             "your own (FILE.py:NAME) or several in turn (A+B), of the daily "
                             "images, the hold-out and the validation set")
    parser.add_argument("--arms", help="comma-separated arms, names or letters: "
                        + "; ".join(f"{name} {text}" for name, text in ARMS.items())
                        + " (default: all that apply)")
    parser.add_argument("--seeds", type=seed_list,
                        help="comma-separated seeds of the days' draws and training (default: "
                             "--seed); the last day is pooled over them")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--work", default=str(Path.home() / ".cache" / "odtd" / "reproduce"),
                        help="cache and working directory (default ~/.cache/odtd/reproduce)")
    parser.add_argument("--pretrain-images", type=int, default=20000)
    parser.add_argument("--pretrain-batch", type=int, default=32,
                        help="batch size (32: the fastest on a 2-core CPU, 24.7 samples/s)")
    parser.add_argument("--pretrain-lr", type=float, default=0.05)
    parser.add_argument("--pretrain-chunk", type=int, default=1, help="epochs per worker run")
    parser.add_argument("--pretrain-max-epochs", type=int, default=4)
    parser.add_argument("--pretrain-decay-epoch", type=int, default=1,
                        help="--pretrain-lr before this epoch, a fifth of it after")
    parser.add_argument("--pretrain-anneal-epoch", type=int, default=2,
                        help="a 25th of --pretrain-lr from this epoch on")
    parser.add_argument("--target", type=float, default=0.60, help="check-set accuracy to stop at")
    parser.add_argument("--validation-images", type=int, default=5000,
                        help="fixed validation set (training images nobody trains on); 5,000 keep "
                             "the standard error of a gain near 0.4 points")
    parser.add_argument("--test-images", type=int, default=10000,
                        help="test images every arm is scored on after the last day (fewer: a "
                             "quick trial)")
    parser.add_argument("--daily-test-images", type=int, default=2000,
                        help="test images every arm is scored on every day (10000: all of them)")
    parser.add_argument("--replay-seed", type=int, default=20000,
                        help="pre-training images shipped with the base model to seed the replay "
                             "buffer (default: all of them; 0: the buffer starts empty)")
    parser.add_argument("--model", default="densenet40",
                        help="built-in network (default densenet40, the published one; tinycnn: a "
                             "quick trial of the whole path)")
    parser.add_argument("--import-model", action="store_true",
                        help="give odtd the pre-trained model as a user would: exported to a "
                             ".keras file and imported with init --model-file; every arm, "
                             "the controls and the scoring then run that imported model")
    parser.add_argument("--policy", default=str(REPO / "policies" / "densenet40.yaml"),
                        help="odtd's policy (the recipe; default policies/densenet40.yaml, the "
                             "published scenario's; for a --shift camera the measured recipe is "
                             "policies/new-camera.yaml); precision and eval batch come from here")
    parser.add_argument("--precision", default="auto", help="fp32 | mixed_bfloat16 | auto")
    parser.add_argument("--telemetry", default="auto", help="telemetry backend (default auto)")
    parser.add_argument("--plot", metavar="PNG",
                        help="also draw every arm per day, shifted and clean, into this PNG "
                             "(as `odtctl plot --arms` does from the --json summary)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the pre-training, validation and test images")
    parser.add_argument("--priors", metavar="dirichlet:ALPHA",
                        help="the device sees the classes unevenly: its mix a Dirichlet draw "
                             "(fixed per --seed); its images, validation set and 'device' test "
                             "images follow it, the 'clean' test images stay evenly mixed")
    parser.add_argument("--stream", metavar="runs:MEAN",
                        help="the device's images arrive in runs of one class of that mean length, "
                             "in order and across days")
    parser.add_argument("--unlabelled", type=int, default=0, metavar="K",
                        help="K more images a day from the same camera and mix, without labels "
                             "(odtd ingests them as unlabelled; AdaBN and the priors arm read them)")
    args = parser.parse_args()
    try:  # a bad --shift, --arms or scenario (or `--shift help`) is answered before any work
        if args.shift:
            get_shift(args.shift)
        scenario = Scenario.parse(args.priors, args.stream, args.unlabelled)
        parse_arms(args.arms, bool(args.shift), scenario.priors is not None, not scenario.even)
    except OdtdError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    if not args.cifar or not Path(args.cifar).exists():
        print(f"Error: --cifar {args.cifar!r}: no such file; pass the CIFAR-10 archive "
              "(../shared/datasets/cifar10-jpeg.tar.gz)", file=sys.stderr)
        return 1
    try:
        summary = run(args)
    except OdtdError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2) if args.json else table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
