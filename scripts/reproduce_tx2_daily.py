#!/usr/bin/env python3
"""The published on-device scenario on CIFAR-10: DenseNet40, 64 new images a day, 17 days.

Published (TX2, plain fine-tuning): test accuracy 60.65% -> 61.32% over 17 days.

1. Pre-train densenet40 on part of the training set until the validation set reaches --target (60%)
   (cached under --work, so reruns skip it).
2. odtd: a real ODTD_HOME initialised with those weights and a fixed validation set of training
   images used by nobody else; each day 64 unseen training images are ingested (odtd's Ingestor)
   and a session runs (odtd's SessionRunner: replay seeded with the pre-training images, each
   session going on from the last refused candidate, promotion only of a gain two standard
   errors clear of zero; the recipe is --policy, policies/densenet40.yaml by default).
3. plain: the same days with plain fine-tuning (all 64 images, BatchNorm trained, SGD 0.005,
   momentum 0.9, 3 epochs, no replay, no acceptance guard), as in the published experiment.
4. odtd's model is scored on all 10,000 test images whenever it changes (day 0 and each
   promotion: a rolled-back day serves the same model), so its every day is a full-set figure.
   Plain fine-tuning changes its model every day; it is scored on all 10,000 on the last day and
   on a fixed class-balanced subset every day (--daily-test-images, 2,000 by default; 10000
   scores the whole set), which the full evaluations also report: the table shows both models
   on the subset. On a 2-core CPU one 10,000-image evaluation of DenseNet40 takes over 2 minutes.

Usage: scripts/reproduce_tx2_daily.py --cifar ../shared/datasets/cifar10-jpeg.tar.gz [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

import numpy as np

from odtd.config import Config, TelemetryConfig
from odtd.home.create import init_home
from odtd.home.ingest import Ingestor, discover
from odtd.home.paths import Home
from odtd.home.versions import ModelRepo
from odtd.policy import Policy, load_policy
from odtd.session.runner import SessionRunner
from odtd.sim import datasets
from odtd.telemetry.meter import SessionEnergyMeter, running_sampler
from odtd.trainer.job import make_job
from odtd.trainer.launch import run_job

PUBLISHED = {"day0": 60.65, "day17": 61.32}
REPO = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


MODEL = "densenet40"  # --model


def job(mode: str, **fields):
    return make_job(mode, MODEL, datasets.CLASSES, [32, 32, 3], **fields)


def worker(spec: dict, tmp: Path, show_steps: int = 0) -> dict:
    command = Config().trainer.command()

    def progress(message):
        if show_steps and message.get("event") == "step" and message["index"] % show_steps == 0:
            log(f"  step {message['index']} loss {message['loss']:.3f}")

    result, _, _ = run_job(command, spec, tmp, on_message=progress)
    return result


def evaluate(weights: Path, test_npz: Path, work: Path, precision: str) -> dict:
    """Score weights on a test ``.npz``; ``{"all": accuracy, "daily": accuracy on group 1}``.

    The full test file marks the daily subset as group 1, so one pass gives both figures; the
    daily file has no groups and is the subset itself.
    """
    log(f"  scoring {weights.name} on {test_npz.name} ...")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        result = worker(job("evaluate", weights_in=str(weights), validation_data=str(test_npz),
                            batch_size=64, eval_batch_size=250, precision=precision), Path(tmp))
    by_group = result.get("by_group_after") or {}
    scores = {"all": result["accuracy_after"], "daily": by_group.get("1", result["accuracy_after"])}
    log(f"  {scores['all']:.2%} ({time.monotonic() - started:.0f} s)")
    return scores


def pretrain(args, ds, work: Path, pretrain_idx, check_npz: Path, test_npz: Path) -> dict:
    """Train from scratch until the check set reaches the target; cached by its settings."""
    model = "" if MODEL == "densenet40" else f"{MODEL}-"  # the cache of earlier runs stays valid
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
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            worker(job("init", weights_out=str(current), seed=args.seed), Path(tmp))
        epochs, history = 0, []
    while epochs < args.pretrain_max_epochs:
        # Step decay: a high rate to learn fast, a fifth of it to settle, a 25th to anneal.
        rate = args.pretrain_lr / (1 if epochs < args.pretrain_decay_epoch else
                                   5 if epochs < args.pretrain_anneal_epoch else 25)
        with tempfile.TemporaryDirectory(dir=work) as tmp:
            out = work / "pretrain-next.npz"
            result = worker(job("train", weights_in=str(current), weights_out=str(out),
                                train_data=str(data), validation_data=str(check_npz),
                                batch_size=args.pretrain_batch,
                                epochs=args.pretrain_chunk, optimizer="sgd", learning_rate=rate,
                                momentum=0.9, augment=True, seed=args.seed + epochs,
                                precision=args.precision, eval_batch_size=250), Path(tmp),
                            show_steps=100)
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
            "history": history, "seconds": seconds,
            "test": evaluate(weights, test_npz, work, args.precision)}
    meta.write_text(json.dumps(info, indent=2))
    log(f"pre-trained in {seconds} s: test accuracy {info['test']['all']:.2%}")
    return info


def odtd_policy(path: Path, precision: str) -> Policy:
    """The policy file's recipe, with this machine's precision and large evaluation batches."""
    policy = load_policy(path)
    training = policy.training.model_copy(update={"precision": precision, "eval_batch_size": 250})
    return policy.model_copy(update={"training": training})


def run(args) -> dict:
    started = time.monotonic()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log(f"reading {args.cifar} ...")
    ds = datasets.open_dataset(Path(args.cifar))
    train_files = ds.files("train")
    labels = np.array([label for _, label in train_files])
    pretrain_idx = datasets.take_per_class(labels, args.pretrain_images // 10, seed=args.seed)
    check_idx = datasets.take_per_class(labels, args.validation_images // 10, seed=args.seed + 1,
                                        exclude=pretrain_idx)
    used = np.concatenate([pretrain_idx, check_idx])
    draws = datasets.daily_draws(labels, args.days, args.per_day, seed=args.seed + 2, exclude=used)
    test_files = ds.files("test")
    test_idx = (None if args.test_images >= len(test_files) else datasets.take_per_class(
        [label for _, label in test_files], args.test_images // 10, seed=args.seed + 4))
    test_x, test_y = ds.load_arrays("test", test_idx)
    daily_idx = datasets.take_per_class(test_y, args.daily_test_images // 10, seed=args.seed + 3)
    in_daily = np.zeros(len(test_y), np.int64)
    in_daily[daily_idx] = 1
    np.savez(work / "test.npz", x=test_x, y=test_y, group=in_daily)
    daily_npz = work / "test-daily.npz"
    np.savez(daily_npz, x=test_x[daily_idx], y=test_y[daily_idx])
    log(f"test set: {len(test_y)} images, {len(daily_idx)} scored every day")
    check_x, check_y = ds.load_arrays("train", check_idx)
    np.savez(work / "check.npz", x=check_x, y=check_y)
    base = pretrain(args, ds, work, pretrain_idx, work / "check.npz", work / "test.npz")

    home = Home(work / "odtd-home")
    policy = odtd_policy(Path(args.policy), args.precision)
    # Written before init, which keeps an existing policy file: the replay capacity applies to
    # the seed as well.
    home.root.mkdir(parents=True, exist_ok=True)
    (home.root / "policy.yaml").write_text(
        f"# written by reproduce_tx2_daily.py: {args.policy} with precision and eval batch size\n"
        + json.dumps(policy.model_dump(), indent=2))
    # The base model ships with its validation set and a class-balanced share of its training
    # images, which seed the replay buffer (odtctl init --validation DIR --replay DIR).
    seed_dir = work / "replay-seed"
    shutil.rmtree(seed_dir, ignore_errors=True)
    seed_idx = pretrain_idx[:args.replay_seed]
    ds.extract("train", [train_files[i][0] for i in seed_idx], seed_dir)
    log(f"odtd home: base model, {len(check_y)} validation images, {len(seed_idx)} replay seed images")
    init_home(home, MODEL, list(datasets.CLASSES), weights=Path(base["weights"]), force=True,
              validation_arrays=(check_x, check_y), replay=seed_dir if len(seed_idx) else None)
    shutil.rmtree(seed_dir)
    plain_weights = work / "plain-current.npz"
    shutil.copyfile(base["weights"], plain_weights)
    # odtd's test scores (all images and the daily subset) by model version: a rolled-back day
    # keeps the model, so its evaluation is not repeated. Version 0 is the base, already scored.
    odtd_tested = {0: base["test"]}
    rows = [{"day": 0, "odtd_test_accuracy": base["test"]["all"],
             "odtd_daily_subset": base["test"]["daily"], "plain_test_accuracy": base["test"]["daily"]}]
    final = {"odtd": base["test"], "plain": base["test"]}
    store = home.open_store()
    config = home.load_config()
    start_day = date(2026, 1, 1)
    try:
        with running_sampler(TelemetryConfig(backend=args.telemetry)) as sampler:
            runner = SessionRunner(home, store, config, load_policy(home.root / "policy.yaml"),
                                   energy_meter=SessionEnergyMeter(sampler))
            ingestor = Ingestor.for_home(home, store)
            for day in range(1, args.days + 1):
                stamp = (start_day + timedelta(days=day - 1)).isoformat()
                names = [train_files[i][0] for i in draws[day - 1]]
                with tempfile.TemporaryDirectory(dir=work) as tmp:
                    ds.extract("train", names, Path(tmp) / "images")
                    ingestor.ingest(discover(Path(tmp) / "images", None), day=stamp)
                    session = runner.run(trigger="simulate", day=stamp).to_dict()
                    day_x, day_y = ds.load_arrays("train", draws[day - 1])
                    np.savez(Path(tmp) / "day.npz", x=day_x, y=day_y)
                    out = Path(tmp) / "plain.npz"
                    worker(job("train", weights_in=str(plain_weights), weights_out=str(out),
                               train_data=str(Path(tmp) / "day.npz"), batch_size=16, epochs=3,
                               optimizer="sgd", learning_rate=0.005, momentum=0.9, augment=False,
                               freeze_bn=False, seed=args.seed + day, precision=args.precision),
                           Path(tmp) / "plain")
                    shutil.move(out, plain_weights)
                repo = ModelRepo(home.models, MODEL)
                version = repo.current()
                if version not in odtd_tested:
                    odtd_tested[version] = evaluate(repo.weights_path(version), work / "test.npz",
                                                    work, args.precision)
                odtd_scores = odtd_tested[version]
                # Plain's last day is scored on the whole test set, which reports the subset too.
                plain_scores = evaluate(plain_weights, work / "test.npz" if day == args.days
                                        else daily_npz, work, args.precision)
                if day == args.days:
                    final = {"odtd": odtd_scores, "plain": plain_scores}
                odtd_acc, plain_acc = odtd_scores["all"], plain_scores["daily"]
                rows.append({"day": day, "odtd_test_accuracy": odtd_acc,
                             "odtd_daily_subset": odtd_scores["daily"], "plain_test_accuracy": plain_acc,
                             "outcome": session["outcome"], "model_version": version,
                             "validation_before": session["accuracy_before"],
                             "validation_after": session["accuracy_after"],
                             "batch_size": session["batch_size"],
                             "energy_j": session["energy_j"], "energy_source": session["energy_source"],
                             "peak_memory_mb": session["peak_memory_mb"],
                             "session_s": session["duration_s"]})
                log(f"day {day}: odtd {odtd_acc:.2%} ({session['outcome']}), plain {plain_acc:.2%} "
                    "(subset), "
                    f"energy {session['energy_j']} J, peak {session['peak_memory_mb']} MB")
    finally:
        store.close()
    sessions = rows[1:]
    summary = {
        "machine": f"{os.uname().machine}, {os.cpu_count()} CPUs, no GPU",
        "published": PUBLISHED, "days": args.days, "per_day": args.per_day,
        "test_images": {"day0_and_final": len(test_y), "daily": len(daily_idx)},
        "policy": args.policy, "acceptance": policy.acceptance.model_dump(),
        "replay_seed": len(seed_idx),
        "pretrain": {"images": base["images"], "epochs": base["epochs"], "seconds": base["seconds"],
                     "history": base["history"], "test_accuracy": base["test"]["all"]},
        "odtd": {"day0": base["test"]["all"], "final": final["odtd"]["all"],
                 "gain_points": 100 * (final["odtd"]["all"] - base["test"]["all"]),
                 "min": min(r["odtd_test_accuracy"] for r in rows),
                 "days_below_day0": sum(r["odtd_test_accuracy"] < rows[0]["odtd_test_accuracy"]
                                        for r in rows),
                 "daily_min": min(r["odtd_daily_subset"] for r in rows),
                 "energy_j_total": round(sum(r["energy_j"] or 0 for r in sessions), 1),
                 "peak_memory_mb": max(r["peak_memory_mb"] or 0 for r in sessions),
                 "outcomes": {o: sum(r["outcome"] == o for r in sessions)
                              for o in ("promoted", "rolled_back", "failed")}},
        "plain": {"day0": base["test"]["all"], "final": final["plain"]["all"],
                  "gain_points": 100 * (final["plain"]["all"] - base["test"]["all"]),
                  "daily_min": min(r["plain_test_accuracy"] for r in rows),
                  "days_below_day0": sum(r["plain_test_accuracy"] < rows[0]["plain_test_accuracy"]
                                         for r in rows)},
        "rows": rows, "wall_s": round(time.monotonic() - started, 1),
    }
    if args.plot:
        summary["plot"] = str(plot(rows, Path(args.plot), summary))
    return summary


def plot(rows, out: Path, summary) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    days = [r["day"] for r in rows]
    fig, (ax, ax_e) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 1]})
    full, subset = summary["test_images"]["day0_and_final"], summary["test_images"]["daily"]
    ax.plot(days, [100 * r["odtd_test_accuracy"] for r in rows], "o-", color="C0",
            label=f"odtd (replay + guard), all {full:,} test images")
    ax.plot(days, [100 * r["odtd_daily_subset"] for r in rows], "-", color="C0", alpha=0.4,
            label=f"odtd, {subset:,}-image subset")
    ax.plot(days, [100 * r["plain_test_accuracy"] for r in rows], "s--", color="C1",
            label=f"plain fine-tuning, {subset:,}-image subset")
    ax.plot([summary["days"]], [100 * summary["plain"]["final"]], "s", mfc="none", ms=11,
            color="C1", label=f"plain, day {summary['days']} on all {full:,}")
    ax.plot([0, summary["days"]], [PUBLISHED["day0"], PUBLISHED["day17"]], ":", color="grey",
            label="published TX2 (60.65 -> 61.32)")
    ax.set_ylabel("CIFAR-10 test accuracy (%)")
    ax.set_title("DenseNet40, 64 new images a day")
    ax.grid(alpha=0.3)
    ax.legend()
    ax_e.bar(days[1:], [r["energy_j"] or 0 for r in rows[1:]])
    source = rows[1].get("energy_source") if len(rows) > 1 else None
    ax_e.set_ylabel(f"session energy (J)\n{source}")
    ax_e.set_xlabel("day")
    ax_e.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def table(summary) -> str:
    full, subset = summary["test_images"]["day0_and_final"], summary["test_images"]["daily"]
    lines = [f"test accuracy: odtd on all {full:,} test images and on the {subset:,}-image subset; "
             "plain fine-tuning on the subset",
             "day  odtd all  odtd sub  plain sub  outcome      batch  energy J  peak MB"]
    for r in summary["rows"]:
        line = (f"{r['day']:3d}  {100 * r['odtd_test_accuracy']:7.2f}%  "
                f"{100 * r['odtd_daily_subset']:7.2f}%  {100 * r['plain_test_accuracy']:8.2f}%")
        if r["day"]:
            line += (f"  {r['outcome']:<11}  {r['batch_size']:5d}  {r['energy_j'] or 0:8.1f}  "
                     f"{r['peak_memory_mb']:7.0f}")
        lines.append(line)
    o, p = summary["odtd"], summary["plain"]
    lines.append(f"all {full:,} test images: day 0 {100 * o['day0']:.2f}%, "
                 f"day {summary['days']} odtd {100 * o['final']:.2f}% ({o['gain_points']:+.2f} points), "
                 f"plain {100 * p['final']:.2f}% ({p['gain_points']:+.2f}); "
                 f"published {PUBLISHED['day0']} -> {PUBLISHED['day17']} "
                 f"(+{PUBLISHED['day17'] - PUBLISHED['day0']:.2f}); wall {summary['wall_s']} s")
    return "\n".join(lines)


def main() -> int:
    global MODEL
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cifar", default=os.environ.get("ODTD_CIFAR10"),
                        help="CIFAR-10 JPEG tar.gz or folder (or $ODTD_CIFAR10)")
    parser.add_argument("--days", type=int, default=17)
    parser.add_argument("--per-day", type=int, default=64)
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
                        help="test images each odtd model and plain's last day are scored on "
                             "(fewer: a quick trial)")
    parser.add_argument("--daily-test-images", type=int, default=2000,
                        help="test images scored every day (10000: all of them)")
    parser.add_argument("--replay-seed", type=int, default=20000,
                        help="pre-training images shipped with the base model to seed the replay "
                             "buffer (default: all of them; 0: the buffer starts empty)")
    parser.add_argument("--model", default=MODEL,
                        help="built-in network (default densenet40, the published one; tinycnn: a "
                             "quick trial of the whole path)")
    parser.add_argument("--policy", default=str(REPO / "policies" / "densenet40.yaml"),
                        help="odtd's policy (the recipe); precision and eval batch come from here")
    parser.add_argument("--precision", default="auto", help="fp32 | mixed_bfloat16 | auto")
    parser.add_argument("--telemetry", default="auto", help="telemetry backend (default auto)")
    parser.add_argument("--plot", default=str(REPO / "docs" / "reproduce_tx2_daily.png"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.cifar or not Path(args.cifar).exists():
        print(f"Error: --cifar {args.cifar!r}: no such file; pass the CIFAR-10 archive "
              "(../shared/datasets/cifar10-jpeg.tar.gz)", file=sys.stderr)
        return 1
    MODEL = args.model
    summary = run(args)
    print(json.dumps(summary, indent=2) if args.json else table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
