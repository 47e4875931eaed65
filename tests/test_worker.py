"""The trainer worker, run for real: subprocesses, TensorFlow, tinycnn on tiny synthetic data.

TensorFlow is only ever imported in child processes, never in the test process.
"""

import ctypes
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import WORKER_PYTHON, bfloat16_refused, built_once, tensorflow_report

from odtd.config import TrainerConfig
from odtd.trainer.learning import step
from odtd.trainer.plans import precision
from odtd.trainer.protocol import catalog, procfs

pytestmark = pytest.mark.trains  # every test here runs the real worker

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["red", "green", "blue"]
SHAPE = [32, 32, 3]


def write_samples(path: Path, count: int, labels=None, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (count, *SHAPE), dtype=np.uint8)
    y = rng.integers(0, len(CLASSES), count) if labels is None else np.asarray(labels)
    np.savez(path, x=x, y=y.astype(np.int64))
    return str(path)


def write_job(directory: Path, name: str = "job", **keys) -> Path:
    job = {
        "protocol": 1, "mode": "train", "model": "tinycnn", "classes": CLASSES,
        "input_shape": SHAPE, "weights_in": None, "weights_out": None, "train_data": None,
        "validation_data": None, "batch_size": 8, "epochs": 2, "max_steps": None,
        "optimizer": "sgd", "learning_rate": 0.05, "momentum": 0.9, "augment": False,
        "freeze_bn": False, "seed": 0, "parent_pid": None, "precision": "fp32",
        "gpu_memory_limit_mb": None,
    }
    job.update(keys)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(job))
    return path


def worker_command(job_path: Path) -> list:
    return [*TrainerConfig(python=WORKER_PYTHON).command(), str(job_path)]


def run_worker(job_path: Path, timeout_s: float = 120):
    proc = subprocess.run(worker_command(job_path), capture_output=True, text=True, cwd=REPO,
                          timeout=timeout_s)
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    return proc.returncode, events, proc.stderr


def by_event(events, name):
    return [e for e in events if e["event"] == name]


def bn_statistics(weights_path, names):
    with np.load(weights_path, allow_pickle=False) as arrays:
        return {name: arrays[f"w{i:04d}"] for i, name in enumerate(names)
                if "moving_mean" in name or "moving_variance" in name}


@pytest.fixture(scope="session")
def initial(tmp_path_factory):
    """One init run: (weights path, result event)."""
    def build(directory: Path) -> None:
        code, events, stderr = run_worker(write_job(
            directory, mode="init", weights_out=str(directory / "init.npz"), seed=7))
        assert code == 0, stderr
        (directory / "result.json").write_text(json.dumps(by_event(events, "result")[0]))

    directory = built_once(tmp_path_factory, "init", build)
    return directory / "init.npz", json.loads((directory / "result.json").read_text())


@pytest.fixture
def data(tmp_path):
    """Training data and a validation set that has no sample of the last class."""
    return {"train_data": write_samples(tmp_path / "train.npz", 40, seed=1),
            "validation_data": write_samples(tmp_path / "val.npz", 12, labels=[0] * 6 + [1] * 6,
                                             seed=2)}


def test_catalog_counts_equal_the_built_keras_models():
    script = (
        "import json; from odtd.trainer.models import networks; print(json.dumps({"
        "'densenet40': networks.build('densenet40', 10).count_params(),"
        "'tinycnn': networks.build('tinycnn', 10).count_params(),"
        "'tinycnn_gray_3': networks.build('tinycnn', 3, (16, 16, 1)).count_params()}))"
    )
    keras_counts = tensorflow_report(script)
    assert keras_counts["densenet40"] == catalog.param_count("densenet40", 10)
    assert 900_000 <= keras_counts["densenet40"] <= 1_100_000
    assert keras_counts["tinycnn"] == catalog.param_count("tinycnn", 10)
    assert keras_counts["tinycnn_gray_3"] == catalog.param_count("tinycnn", 3, (16, 16, 1))


def test_catalog_rejects_unknown_model_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model 'resnet9000'; known models: densenet121, "
                                          r"densenet40, inceptionv1"):
        catalog.param_count("resnet9000", 10)
    assert len(catalog.DEFAULT_CLASSES) == 10 and catalog.DEFAULT_CLASSES[0] == "airplane"


def test_init_writes_fresh_weights_of_the_catalog_size(initial):
    weights, result = initial
    assert result["status"] == "ok" and result["steps"] == 0
    assert result["param_count"] == catalog.param_count("tinycnn", len(CLASSES))
    with np.load(weights, allow_pickle=False) as arrays:
        assert sorted(arrays.files) == [f"w{i:04d}" for i in range(len(result["weight_names"]))]
        assert sum(arrays[key].size for key in arrays.files) == result["param_count"]
    assert not Path(str(weights) + ".tmp").exists()


def test_train_reports_ordered_spans_and_writes_loadable_weights(tmp_path, initial, data):
    out = tmp_path / "candidate.npz"
    job = write_job(tmp_path, weights_in=str(initial[0]), weights_out=str(out), augment=True,
                    **data)
    code, events, stderr = run_worker(job)
    assert code == 0, stderr
    kinds = [e["event"] for e in events]
    assert kinds == ["start", "eval"] + ["step"] * 10 + ["eval", "result"]
    start, result = events[0], events[-1]
    assert start["precision"] == "fp32" and start["pid"] > 0
    steps = by_event(events, "step")
    assert [s["index"] for s in steps] == list(range(10))
    assert [s["epoch"] for s in steps] == [0] * 5 + [1] * 5
    times = [start["t"]] + [t for s in steps for t in (s["start"], s["end"])]
    assert times == sorted(times)
    before, after = by_event(events, "eval")
    assert (before["phase"], after["phase"]) == ("before", "after")
    assert before["per_class"][2] is None and after["samples"] == 12
    assert result["status"] == "ok" and result["steps"] == 10 and result["samples"] == 80
    assert result["accuracy_after"] == after["accuracy"]
    assert result["weights_out"] == str(out) and result["peak_rss_mb"] > 0
    assert result["tf_peak_memory_mb"] is None  # no GPU here
    assert isinstance(result["heap_released"], bool)  # malloc's free heap, after the first step
    # tinycnn's BatchNorm trains fused in float32 (Keras 3: odtd's kernel; tf.keras 2: its own),
    # so on this CPU Grappler is kept from merging it with its ReLU.
    assert result["batchnorm_relu_apart"] is True
    trained = bn_statistics(out, result["weight_names"])
    initial_stats = bn_statistics(initial[0], result["weight_names"])
    assert any(not np.array_equal(trained[k], initial_stats[k]) for k in trained)


def test_freeze_bn_keeps_moving_statistics(tmp_path, initial, data):
    out = tmp_path / "candidate.npz"
    job = write_job(tmp_path, weights_in=str(initial[0]), weights_out=str(out), freeze_bn=True,
                    **data)
    code, events, stderr = run_worker(job)
    assert code == 0, stderr
    names = events[-1]["weight_names"]
    trained, before = bn_statistics(out, names), bn_statistics(initial[0], names)
    assert len(trained) == 4
    assert events[-1]["batchnorm_relu_apart"] is False  # frozen: nothing trains fused
    for name in trained:
        np.testing.assert_array_equal(trained[name], before[name], err_msg=name)
    with np.load(out) as new, np.load(initial[0]) as old:
        assert not np.array_equal(new["w0000"], old["w0000"])  # the convolutions did train


def test_recalibrated_batchnorm_statistics_depend_only_on_weights_and_data(tmp_path, initial, data):
    # A trained model, and a copy whose moving statistics are scrambled: recalibrating both on
    # the same images (no training steps) gives the same statistics, new ones, and leaves every
    # other weight as it was.
    trained = tmp_path / "trained.npz"
    code, events, stderr = run_worker(write_job(tmp_path, "train", weights_in=str(initial[0]),
                                                weights_out=str(trained), **data))
    assert code == 0, stderr
    names = events[-1]["weight_names"]
    rng = np.random.default_rng(9)
    with np.load(trained) as arrays:
        weights = dict(arrays)
    scrambled = tmp_path / "scrambled.npz"
    np.savez(scrambled, **{key: rng.random(value.shape).astype(value.dtype) + 0.5
                           if "moving_" in names[int(key[1:])] else value
                           for key, value in weights.items()})
    outs = {}
    for name, source in (("from_trained", trained), ("from_scrambled", scrambled)):
        outs[name] = tmp_path / f"{name}.npz"
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(source), weights_out=str(outs[name]), epochs=0,
            recalibrate_bn=True, train_data=data["train_data"]))
        assert code == 0, stderr
        assert events[-1]["steps"] == 0 and events[-1]["recalibrate_seconds"] > 0
    a, b = bn_statistics(outs["from_trained"], names), bn_statistics(outs["from_scrambled"], names)
    before = bn_statistics(trained, names)
    assert len(a) == 4
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
        assert not np.allclose(a[name], before[name]), name
    with np.load(outs["from_scrambled"]) as out:
        for i, name in enumerate(names):
            if "moving_" not in name:
                np.testing.assert_array_equal(out[f"w{i:04d}"], weights[f"w{i:04d}"], err_msg=name)


def test_served_weights_are_scored_before_and_compared_image_by_image(tmp_path, initial, data):
    # A trained candidate, then a job that goes on from it (no steps) judged against the initial
    # weights: "before" is the baseline's score, and the paired counts per group add up to the
    # two accuracies.
    candidate = tmp_path / "candidate.npz"
    code, _, stderr = run_worker(write_job(tmp_path, "train", weights_in=str(initial[0]),
                                           weights_out=str(candidate), learning_rate=0.2, **data))
    assert code == 0, stderr
    rng = np.random.default_rng(3)
    validation = tmp_path / "grouped.npz"
    x = rng.integers(0, 256, (30, *SHAPE), dtype=np.uint8)
    np.savez(validation, x=x, y=rng.integers(0, 3, 30).astype(np.int64),
             group=np.array([0] * 20 + [1] * 10, dtype=np.int64))
    scores = {}
    for name, weights in (("baseline", initial[0]), ("candidate", candidate)):
        code, events, stderr = run_worker(write_job(tmp_path, name, mode="evaluate",
                                                    weights_in=str(weights),
                                                    validation_data=str(validation)))
        assert code == 0, stderr
        scores[name] = events[-1]["by_group_after"]
    assert scores["baseline"] != scores["candidate"]
    code, events, stderr = run_worker(write_job(
        tmp_path, "paired", weights_in=str(candidate), served_weights=str(initial[0]),
        train_data=data["train_data"], validation_data=str(validation), epochs=0))
    assert code == 0, stderr
    result = events[-1]
    assert result["by_group_before"] == scores["baseline"]
    assert result["by_group_after"] == scores["candidate"]
    paired = result["paired_by_group"]
    assert {g: p["samples"] for g, p in paired.items()} == {"0": 20, "1": 10}
    for group, counts in paired.items():
        change = (scores["candidate"][group] - scores["baseline"][group]) * counts["samples"]
        assert counts["gained"] - counts["lost"] == round(change)
    assert sum(p["gained"] + p["lost"] for p in paired.values()) > 0
    assert all("correct" not in e for e in by_event(events, "eval"))


def test_eval_cache_scores_only_samples_it_has_not_seen_for_that_model_and_precision(tmp_path, initial, data):
    # Day 1 scores 12 images and keeps the results; day 2 adds 5 held-out images: only those run,
    # and the figures equal an uncached evaluation's. Another model's or precision's is not used.
    cache = tmp_path / "eval-cache.npz"
    train = data["train_data"]
    rng = np.random.default_rng(5)
    with np.load(data["validation_data"]) as day1:
        x = np.concatenate([day1["x"], rng.integers(0, 256, (5, *SHAPE), dtype=np.uint8)])
        y = np.concatenate([day1["y"], rng.integers(0, 3, 5)])
    grown = tmp_path / "grown.npz"
    np.savez(grown, x=x, y=y, group=np.array([0] * 12 + [1] * 5, dtype=np.int64))

    def before(name, validation, **keys):
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(initial[0]), train_data=train,
            validation_data=str(validation), epochs=0, **keys))
        assert code == 0, stderr
        return by_event(events, "eval")[0], events[-1]

    first, _ = before("day1", data["validation_data"], eval_cache=str(cache))
    assert first["cached"] == 0 and cache.exists()
    second, result = before("day2", grown, eval_cache=str(cache))
    uncached, reference = before("reference", grown)
    assert (second["cached"], uncached["cached"]) == (12, 0)
    assert result["by_group_before"] == reference["by_group_before"]
    assert result["per_class_before"] == reference["per_class_before"]
    assert second["loss"] == pytest.approx(uncached["loss"], rel=1e-5)
    assert result["paired_by_group"] == {"0": {"gained": 0, "lost": 0, "samples": 12},
                                         "1": {"gained": 0, "lost": 0, "samples": 5}}
    # Results really come from the file: a cache that calls every image right is believed.
    with np.load(cache) as kept:
        arrays = dict(kept)
    np.savez(cache, **dict(arrays, correct=np.ones(17, dtype=bool)))
    forged, result = before("forged", grown, eval_cache=str(cache))
    assert forged["cached"] == 17 and forged["accuracy"] == 1.0
    # The same weights at another precision can call images differently: scored afresh.
    other_precision, _ = before("f16", grown, eval_cache=str(cache), precision="mixed_float16")
    assert other_precision["cached"] == 0
    # A trained candidate does not use the initial weights' cache; its own results
    # (eval_cache_out, keyed by the weights file it wrote) are found in full, and are its own.
    candidate, candidate_cache = tmp_path / "candidate.npz", tmp_path / "candidate-cache.npz"
    code, events, stderr = run_worker(write_job(
        tmp_path, "train", weights_in=str(initial[0]), weights_out=str(candidate),
        train_data=train, validation_data=str(grown), eval_cache_out=str(candidate_cache)))
    assert code == 0, stderr
    trained = by_event(events, "eval")[1]
    for cache_file, cached in ((cache, 0), (candidate_cache, 17)):
        code, events, stderr = run_worker(write_job(
            tmp_path, "other", weights_in=str(candidate), train_data=train,
            validation_data=str(grown), epochs=0, eval_cache=str(cache_file)))
        assert code == 0, stderr
        assert by_event(events, "eval")[0]["cached"] == cached
        assert by_event(events, "eval")[0]["accuracy"] == trained["accuracy"]


def test_eval_cache_directory_must_exist(tmp_path, data):
    code, events, _ = run_worker(write_job(tmp_path, eval_cache=str(tmp_path / "no" / "c.npz"),
                                           **data))
    assert code == 2 and "eval_cache: directory" in events[-1]["message"]


def test_served_weights_must_exist(tmp_path, data):
    code, events, _ = run_worker(write_job(tmp_path, served_weights=str(tmp_path / "no.npz"),
                                           **data))
    assert code == 2 and "served_weights: file" in events[-1]["message"]


def test_cosine_schedule_decays_the_rate_within_the_job(tmp_path, initial, data):
    outs = {}
    for schedule in ("constant", "cosine"):
        outs[schedule] = tmp_path / f"{schedule}.npz"
        code, events, stderr = run_worker(write_job(
            tmp_path, schedule, weights_in=str(initial[0]), weights_out=str(outs[schedule]),
            lr_schedule=schedule, **data))
        assert code == 0, stderr
        rates = [e["lr"] for e in by_event(events, "step")]
        assert len(rates) == 10  # 40 samples, batch 8, 2 epochs
        if schedule == "constant":
            assert rates == [0.05] * 10
        else:
            # Keras's CosineDecay, as the optimizer steps through it: 0.05 (1 + cos(pi i / 10)) / 2
            assert rates == pytest.approx([0.025 * (1 + np.cos(np.pi * i / 10)) for i in range(10)])
    with np.load(outs["constant"]) as constant, np.load(outs["cosine"]) as cosine:
        assert any(not np.allclose(constant[k], cosine[k]) for k in constant.files)


def test_unknown_lr_schedule_is_a_bad_job(tmp_path, data):
    code, events, _ = run_worker(write_job(tmp_path, lr_schedule="step", **data))
    assert code == 2 and "lr_schedule='step' is not one of" in events[-1]["message"]


def test_profile_runs_full_batches_in_mixed_float16_and_recalibrates(tmp_path):
    # Recalibration runs in profile mode too, so the profile's peak memory includes it.
    train = write_samples(tmp_path / "train.npz", 5)
    job = write_job(tmp_path, mode="profile", train_data=train, batch_size=16, max_steps=4,
                    optimizer="adam", learning_rate=0.001, augment=True, recalibrate_bn=True,
                    precision="mixed_float16", weights_out=str(tmp_path / "never.npz"))
    code, events, stderr = run_worker(job)
    assert code == 0, stderr
    assert events[0]["precision"] == "mixed_float16"
    assert [s["batch_size"] for s in by_event(events, "step")] == [16] * 4
    assert events[-1]["recalibrate_seconds"] > 0
    # Under mixed precision Keras 3's BatchNorm layers train fused; tf.keras 2's fuse by themselves.
    bn_layers = sum(name.endswith("moving_mean") for name in events[-1]["weight_names"])
    assert bn_layers > 0 and events[-1]["fused_batchnorm"] == (
        bn_layers if events[0]["keras"].startswith("3.") else 0)
    assert events[-1]["batchnorm_relu_apart"] is False  # float16: the remapper is left on
    assert not by_event(events, "eval") and events[-1]["weights_out"] is None
    assert not (tmp_path / "never.npz").exists()


def test_missing_data_file_is_a_bad_job(tmp_path):
    job = write_job(tmp_path, train_data=str(tmp_path / "absent.npz"))
    code, events, _ = run_worker(job, timeout_s=30)
    assert code == 2
    assert events == [{"event": "error", "kind": "bad_job",
                       "message": f"train_data: file {tmp_path / 'absent.npz'} does not exist"}]


def test_unknown_job_key_is_a_bad_job(tmp_path):
    job = write_job(tmp_path, batch_sise=8)
    code, events, _ = run_worker(job, timeout_s=30)
    assert code == 2 and events[0]["kind"] == "bad_job"
    assert "unknown job keys ['batch_sise']" in events[0]["message"]


def test_sigusr1_stops_at_a_step_boundary_without_weights(tmp_path, data):
    out = tmp_path / "candidate.npz"
    job = write_job(tmp_path, weights_out=str(out), epochs=10_000, **data)
    proc = subprocess.Popen(worker_command(job), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        events = []
        for line in proc.stdout:
            events.append(json.loads(line))
            if events[-1]["event"] == "step":
                proc.send_signal(signal.SIGUSR1)
                break
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    events += [json.loads(line) for line in rest.splitlines()]
    assert proc.returncode == 0
    result = events[-1]
    assert result["event"] == "result" and result["status"] == "interrupted"
    assert 1 <= result["steps"] < 50_000 and result["weights_out"] is None
    assert [e["phase"] for e in by_event(events, "eval")] == ["before"]
    assert not out.exists() and not Path(str(out) + ".tmp").exists()


def test_exits_3_when_the_parent_is_not_parent_pid(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    job = write_job(tmp_path, mode="init", weights_out=str(tmp_path / "w.npz"),
                    parent_pid=gone.pid)
    code, events, _ = run_worker(job, timeout_s=30)
    assert code == 3 and events == []


def test_auto_precision_is_measured_once_and_kept_in_the_probe_file(tmp_path):
    """On this machine's CPU: ``auto`` is fp32 without bfloat16 instructions; with them, the
    worker times both and keeps the verdict, which the next job reads instead of measuring."""
    probe = tmp_path / "precision.json"
    job = dict(mode="init", precision="auto", precision_probe=str(probe))
    code, events, stderr = run_worker(write_job(tmp_path, weights_out=str(tmp_path / "a.npz"),
                                                **job))
    assert code == 0, stderr
    start = by_event(events, "start")[0]
    _, flags = procfs.cpu_identity()
    if not flags & precision.BFLOAT16_FLAGS:
        assert start["precision"] == "fp32" and not probe.exists()
        assert start["precision_reason"] == "no bfloat16 instructions on this CPU"
        return
    verdict = json.loads(probe.read_text())
    if verdict.get("probe_error"):  # a TensorFlow without bfloat16 kernels here: fp32, and why
        assert start["precision"] == verdict["precision"] == "fp32"
        assert "bfloat16 convolutions cannot run" in start["precision_reason"]
        assert bfloat16_refused({"tensorflow": start["tensorflow"],  # an old one only
                                 "bfloat16_error": verdict["probe_error"]})
        return
    assert start["precision"] == verdict["precision"] == (
        "mixed_bfloat16" if verdict["bfloat16_speedup"] >= precision.MIN_SPEEDUP else "fp32")
    assert f"{verdict['bfloat16_speedup']:.2f}x" in start["precision_reason"]
    verdict["precision"] = "mixed_bfloat16" if start["precision"] == "fp32" else "fp32"
    probe.write_text(json.dumps(verdict))  # a kept verdict is read, not measured again
    code, events, stderr = run_worker(write_job(tmp_path, weights_out=str(tmp_path / "b.npz"),
                                                **job))
    assert code == 0, stderr
    assert by_event(events, "start")[0]["precision"] == verdict["precision"]


def test_peak_rss_reads_vmhwm_in_mib(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t 104857600 kB\nVmRSS:\t 1024 kB\n")
    assert procfs.peak_rss_mb(str(status)) == 102400.0


def test_release_free_heap_gives_freed_heap_pages_back_to_the_system():
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("the C library has no malloc_trim")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 * 1024  # below malloc's mmap threshold: these come from the heap
    blocks = [libc.malloc(size) for _ in range(1600)]  # 100 MB
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks[:-1]:  # the last one keeps the freed ones off the heap's top
        libc.free(block)
    status = Path("/proc/self/status")
    before = procfs.read_proc_mb("RssAnon", status)
    assert step.release_free_heap()
    assert before - procfs.read_proc_mb("RssAnon", status) > 80
    libc.free(blocks[-1])


def test_a_worker_error_of_several_lines_is_said_in_one(tmp_path):
    from odtd.trainer.protocol.launch import failure_reason

    # As Keras words a configuration it cannot build (seen from tf.keras 2.15).
    message = ("TypeError: Error when deserializing class 'Resizing' using config={...}.\n\n"
               "Exception encountered: ('Keyword argument not understood:', 'data_format')")
    reason = failure_reason(1, {"kind": "exception", "message": message}, tmp_path / "stderr")
    assert reason == ("worker error (exception): TypeError: Error when deserializing class "
                      "'Resizing' using config={...}. Exception encountered: ('Keyword argument "
                      "not understood:', 'data_format')")


def test_trainer_package_stays_python36_compatible():
    vermin = shutil.which("vermin", path=str(Path(sys.executable).parent)) or shutil.which(
        "vermin")
    if vermin is None:
        pytest.skip("vermin is not installed")
    proc = subprocess.run([vermin, "-t=3.6-", "--no-tips", "--violations", "--eval-annotations",
                           "odtd/trainer"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _trained_weights(tmp_path, initial, data, name, **keys):
    out = tmp_path / f"{name}.npz"
    code, events, stderr = run_worker(write_job(
        tmp_path, name, weights_in=str(initial[0]), weights_out=str(out), epochs=1,
        train_data=data["train_data"], batch_size=20, learning_rate=0.05, **keys))
    assert code == 0, stderr
    with np.load(out) as arrays:
        return dict(arrays), events[-1]["weight_names"]


def test_recomputation_trains_the_same_and_moves_batchnorm_statistics_once_per_step(
        tmp_path, initial, data):
    # The same two steps with and without gradient checkpointing: the same weights and the same
    # moving statistics. Recomputing a segment runs its BatchNorm a second time; without putting
    # back what the forward pass left, the statistics would move twice per step.
    plain, names = _trained_weights(tmp_path, initial, data, "plain")
    again, _ = _trained_weights(tmp_path, initial, data, "recomputed", recompute=1.0)
    with np.load(initial[0]) as arrays:
        start = dict(arrays)
    for key, name in zip(sorted(plain), names):
        np.testing.assert_allclose(again[key], plain[key], rtol=1e-4, atol=1e-5, err_msg=name)
    moved = [k for k, n in zip(sorted(plain), names)
             if "moving_mean" in n and not np.allclose(plain[k], start[k])]
    assert len(moved) == 2  # both BatchNorm layers' statistics moved, and by the same amount


def test_micro_batches_take_the_same_step_as_the_whole_batch(tmp_path, initial, data):
    # Frozen BatchNorm: the gradient of the batch is the sum of its micro-batches' gradients.
    whole, names = _trained_weights(tmp_path, initial, data, "whole", freeze_bn=True)
    parts, _ = _trained_weights(tmp_path, initial, data, "micro", freeze_bn=True,
                                micro_batch_size=6)
    with np.load(initial[0]) as arrays:
        start = dict(arrays)
    assert any(not np.allclose(whole[k], start[k]) for k in whole)
    for key, name in zip(sorted(whole), names):
        np.testing.assert_allclose(parts[key], whole[key], rtol=1e-4, atol=1e-5, err_msg=name)


def test_trained_share_averages_the_trained_weights_with_the_served_ones(tmp_path, initial, data):
    # The same steps with trained_share 1 and 0.3: every weight of the second, BatchNorm's
    # moving statistics too, is 0.3 of the first's plus 0.7 of the served model's.
    trained, names = _trained_weights(tmp_path, initial, data, "trained")
    mixed, _ = _trained_weights(tmp_path, initial, data, "mixed", trained_share=0.3)
    with np.load(initial[0]) as arrays:
        served = dict(arrays)
    assert any("moving_mean" in n and not np.allclose(trained[k], served[k])
               for k, n in zip(sorted(trained), names))
    for key, name in zip(sorted(trained), names):
        np.testing.assert_allclose(mixed[key], 0.3 * trained[key] + 0.7 * served[key],
                                   rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_federated_round_averages_with_its_start_not_the_served_model(tmp_path, initial, data):
    # A round starts from the global weights; the device's served model is another. With
    # average_with start the candidate is 0.3 of the trained weights plus 0.7 of the start (the
    # global model plus a share of the device's update); with the default it would be pulled
    # toward the device's own served model. Either way ``trained_out`` gets the trained weights.
    with np.load(initial[0]) as arrays:
        start = dict(arrays)
    served = {key: value + np.asarray(0.05, value.dtype) if value.dtype.kind == "f" else value
              for key, value in start.items()}
    np.savez(tmp_path / "served.npz", **served)
    trained, names = _trained_weights(tmp_path, initial, data, "trained")
    for anchor, weights in (("start", start), ("served", served)):
        mixed, _ = _trained_weights(tmp_path, initial, data, anchor, trained_share=0.3,
                                    served_weights=str(tmp_path / "served.npz"),
                                    average_with=anchor, trained_out=str(tmp_path / f"{anchor}-whole.npz"))
        for key, name in zip(sorted(trained), names):
            np.testing.assert_allclose(mixed[key], 0.3 * trained[key] + 0.7 * weights[key],
                                       rtol=1e-4, atol=1e-5, err_msg=f"{anchor} {name}")
        # What goes back to the server (trained_out): the device's update whole, before the average.
        with np.load(tmp_path / f"{anchor}-whole.npz") as whole:
            for key, name in zip(sorted(trained), names):
                np.testing.assert_allclose(whole[key], trained[key], rtol=1e-4, atol=1e-5,
                                           err_msg=f"{anchor} whole {name}")


def _knows_validation(tmp_path, initial, data):
    """Weights trained 40 epochs on the validation images: a model that knows them."""
    out = tmp_path / "knows-validation.npz"
    code, _, stderr = run_worker(write_job(
        tmp_path, "teach", weights_in=str(initial[0]), weights_out=str(out), epochs=40,
        train_data=data["validation_data"], batch_size=12, learning_rate=0.05))
    assert code == 0, stderr
    return out

def test_a_federated_candidate_is_mixed_with_the_served_model_where_that_scores_higher(
        tmp_path, initial, data):
    # The device serves a model that knows its validation images; the round starts from one
    # that does not (the untrained weights) and barely moves. With training.federated_mix
    # (average_with start+served) and trained_share auto the round's candidate is then
    # averaged with the served model too, at the share that scores best: less than all of the
    # candidate. Without it (start), and in a local session (served), no second average.
    served = _knows_validation(tmp_path, initial, data)

    def result(name, average_with):
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(initial[0]), weights_out=str(tmp_path / f"{name}.npz"),
            epochs=1, train_data=data["train_data"], validation_data=data["validation_data"],
            batch_size=20, learning_rate=1e-6, trained_share="auto", average_with=average_with,
            served_weights=str(served)))
        assert code == 0, stderr
        return by_event(events, "result")[0]

    federated = result("round", "start+served")
    assert federated["accuracy_before"] >= 0.75  # the served model knows them (1.0 on TF 2.21)
    assert len(federated["served_shares_tried"]) == 4
    assert federated["served_share"] < 1.0
    # The mix kept scores above every try of the first average (the candidate without it).
    assert federated["accuracy_after"] > max(max(t.values()) for t in
                                             federated["trained_shares_tried"].values())
    for name, anchor in (("plain-round", "start"), ("local", "served")):
        unmixed = result(name, anchor)
        assert "served_share" not in unmixed and "trained_share" in unmixed


def test_a_federated_round_keeps_its_start_where_the_devices_update_scores_lower(
        tmp_path, initial, data):
    # The round starts from a model that knows the device's validation images; a rate far too
    # high wrecks the trained weights. Under trained_share auto the round also tries share 0,
    # its start as it came, and keeps it: the candidate is the round's model, unchanged. A
    # local session from the same weights tries only 0.25 to 1: some of the update stays.
    start = _knows_validation(tmp_path, initial, data)
    with np.load(start) as arrays:
        kept = dict(arrays)

    def candidate(name, average_with):
        out = tmp_path / f"{name}.npz"
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(start), weights_out=str(out), epochs=3,
            train_data=data["train_data"], validation_data=data["validation_data"], batch_size=20,
            learning_rate=5.0, trained_share="auto", average_with=average_with))
        assert code == 0, stderr
        with np.load(out) as arrays:
            return by_event(events, "result")[0], dict(arrays)

    federated, weights = candidate("round", "start")
    assert sorted(float(share) for share in federated["trained_shares_tried"]) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert federated["trained_share"] == 0.0
    assert federated["accuracy_after"] == federated["accuracy_before"]
    for key in kept:
        np.testing.assert_array_equal(weights[key], kept[key], err_msg=key)
    local, weights = candidate("local", "served")
    assert sorted(float(share) for share in local["trained_shares_tried"]) == [0.25, 0.5, 0.75, 1.0]
    assert local["trained_share"] >= 0.25
    assert any(not np.array_equal(weights[key], kept[key]) for key in kept)

def test_a_rounds_start_is_judged_by_round_confidence_z(tmp_path, initial, data):
    # The round starts from a model that knows the device's validation images (group 0); the
    # device serves the untrained weights; a rate far too high wrecks the trained weights. The
    # acceptance test (z 50) refuses the start's gain, so it is not scored on the reference
    # (group 2) nor kept. With round_confidence_z 0 the start (share 0) is judged as measured:
    # its gain passes, it is scored in full and kept.
    start = _knows_validation(tmp_path, initial, data)
    rng = np.random.default_rng(12)
    with np.load(data["validation_data"]) as known:
        x, y = known["x"], known["y"]
    validation = tmp_path / "round-val.npz"
    np.savez(validation, x=np.concatenate([x, rng.integers(0, 256, (12, *SHAPE), dtype=np.uint8)]),
             y=np.concatenate([y, np.zeros(12)]).astype(np.int64),  # no calibration set
             group=np.repeat(np.array([0, 2], dtype=np.int64), 12))

    def result(name, **keys):
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(start), served_weights=str(initial[0]),
            weights_out=str(tmp_path / f"{name}.npz"), epochs=3, validation_data=str(validation),
            batch_size=20, learning_rate=5.0, trained_share="auto", average_with="start",
            acceptance_tolerance=0.0, confidence_z=50.0, reference_tolerance=1.0,
            **{"train_data": data["train_data"], **keys}))
        assert code == 0, stderr
        return by_event(events, "result")[0]

    refused = result("refused")
    start_tried = refused["trained_shares_tried"]["0.0"]
    assert start_tried["0"] > refused["by_group_before"]["0"]  # the start gains...
    assert set(start_tried) == {"0"}  # ...but not 50 standard errors: not scored in full
    judged = result("judged", round_confidence_z=0.0)
    assert set(judged["trained_shares_tried"]["0.0"]) == {"0", "2"}
    assert judged["trained_share"] == 0.0
    assert judged["by_group_after"] == judged["trained_shares_tried"]["0.0"]
    # With the device's priors the candidate is scored again after the share is kept (with
    # its own offset): by the same test, so the guard that passes it finds the reference scored.
    with np.load(data["train_data"]) as train:
        np.savez(tmp_path / "device-train.npz", x=train["x"], y=train["y"],
                 device=np.ones(len(train["y"]), bool))
    offset = result("offset", round_confidence_z=0.0, prior_correction=True,
                    train_data=str(tmp_path / "device-train.npz"))
    assert offset["trained_share"] == 0.0 and offset["logit_offset_after"] is not None
    assert set(offset["by_group_after"]) == {"0", "2"}


def test_fedprox_proximal_term_keeps_the_weights_near_their_start(tmp_path, initial, data):
    # The same eight steps with and without FedProx's proximal term: with it every trained
    # weight ends nearer its start (the round's global model), and mu 0 is the plain step.
    with np.load(initial[0]) as arrays:
        start = dict(arrays)

    def moved(name, **keys):
        out = tmp_path / f"{name}.npz"
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(initial[0]), weights_out=str(out), epochs=2,
            train_data=data["train_data"], batch_size=10, learning_rate=0.05, freeze_bn=True, **keys))
        assert code == 0, stderr
        with np.load(out) as arrays:
            return sum(float(np.sum((arrays[k] - start[k]) ** 2)) for k in start)

    plain, zero, held = moved("plain"), moved("mu0", proximal_mu=0.0), moved("prox", proximal_mu=10.0)
    assert plain > 0 and zero == plain
    assert held < 0.5 * plain


TRIED = {"bn_device_share": "bn_shares_tried", "trained_share": "trained_shares_tried"}


def _auto(tmp_path, initial, name, train, validation, key, tolerance, **keys):
    """Train with ``key`` auto; return (weights written, result, tries, kept, tries in full).

    The tries are ``{try: accuracy by group}``; those scored in full have the reference, "2".
    """
    out = tmp_path / f"{name}.npz"
    code, events, stderr = run_worker(write_job(
        tmp_path, name, weights_in=str(initial[0]), weights_out=str(out), epochs=1,
        freeze_bn=True, train_data=str(train), validation_data=str(validation),
        reference_tolerance=tolerance, **{key: "auto"}, **keys))
    assert code == 0, stderr
    result = events[-1]
    tried = {float(w): groups for w, groups in result[TRIED[key]].items()}
    full = {w: groups for w, groups in tried.items() if "2" in groups}
    return out, result, tried, result[key], full


def _scored(tmp_path, name, weights, validation):
    """A separate evaluate run's accuracy by group of ``weights``."""
    code, events, stderr = run_worker(write_job(
        tmp_path, name, mode="evaluate", weights_in=str(weights), validation_data=str(validation)))
    assert code == 0, stderr
    return events[-1]["by_group_after"]


def test_trained_share_auto_keeps_the_best_share_that_spares_the_reference(tmp_path, initial):
    # trained_share auto: a session teaches class 2 for the device's dark images, and the
    # reference set is bright images labelled as the served model sees them (its most
    # frequent class). Each of AUTO_SHARES is scored; the shares that gain most on the dark
    # images forget the reference, so the share kept is one that spares it, by choose_weight's
    # rule on those scored in full; the weights written are that average, as a separate
    # evaluate run confirms.
    from odtd.trainer.learning.averaging import AUTO_SHARES
    from odtd.trainer.learning.batchnorm import choose_weight

    rng = np.random.default_rng(11)
    dark = rng.integers(0, 60, (40, *SHAPE), dtype=np.uint8)
    bright = rng.integers(150, 256, (20, *SHAPE), dtype=np.uint8)
    seen = tmp_path / "seen.npz"  # the bright images under each label, one group per label
    np.savez(seen, x=np.concatenate([bright] * 3), y=np.repeat(np.arange(3), 20),
             group=np.repeat(np.arange(3), 20))
    seen_as = _scored(tmp_path, "seen", initial[0], seen)
    served_class = max(range(3), key=lambda c: seen_as[str(c)])
    train = tmp_path / "share-train.npz"
    np.savez(train, x=dark[:20], y=np.full(20, 2, dtype=np.int64), device=np.ones(20, bool))
    validation = tmp_path / "share-val.npz"
    np.savez(validation, x=np.concatenate([dark[20:], bright]),
             y=np.concatenate([np.full(20, 2), np.full(20, served_class)]).astype(np.int64),
             group=np.concatenate([np.zeros(20), np.full(20, 2)]).astype(np.int64))
    out, result, tried, kept, full = _auto(tmp_path, initial, "share", train, validation,
                                           "trained_share", 0.1, batch_size=10,
                                           learning_rate=0.05)
    assert sorted(tried) == list(AUTO_SHARES)
    reference_before = result["by_group_before"]["2"]
    assert tried[1.0]["2"] < reference_before - 0.1  # trained alone: forgets
    assert tried[kept]["2"] >= reference_before - 0.1  # kept: spares the reference...
    assert max(groups["0"] for groups in tried.values()) > tried[kept]["0"]  # ...at a cost
    assert kept == choose_weight(full, result["by_group_before"]["2"], 0.1, "0", "2")
    assert result["by_group_after"] == tried[kept]
    assert _scored(tmp_path, "share-check", out, validation) == tried[kept]


def _adapted(tmp_path, initial, name, x, device, device_x=None, weight=1.0, **keys):
    """BatchNorm statistics after a 0-epoch job adapting them (frozen BN) to the device's images."""
    train = tmp_path / f"{name}-train.npz"
    extra = {} if device_x is None else {"device_x": device_x}
    np.savez(train, x=x, y=np.zeros(len(x), dtype=np.int64), device=np.asarray(device), **extra)
    out = tmp_path / f"{name}.npz"
    code, events, stderr = run_worker(write_job(
        tmp_path, name, weights_in=str(initial[0]), weights_out=str(out), epochs=0, batch_size=64,
        freeze_bn=True, train_data=str(train), bn_device_share=weight, **keys))
    assert code == 0, stderr
    assert events[-1]["adapt_seconds"] > 0
    names = events[-1]["weight_names"]
    return bn_statistics(out, names), names, out


def test_batchnorm_adapts_to_a_mixture_of_device_and_rehearsed_images(tmp_path, initial):
    # Device images are dark, rehearsed ones bright. Weight 1 measures the device's images
    # alone (here half of them in device_x, not trained on); weight 0 the rehearsed ones; 0.5
    # their mixture's moments. Frozen BatchNorm is adapted too; nothing else changes.
    rng = np.random.default_rng(3)
    dark = rng.integers(0, 60, (20, *SHAPE), dtype=np.uint8)
    bright = rng.integers(150, 256, (20, *SHAPE), dtype=np.uint8)
    x = np.concatenate([dark, bright])
    mask = np.arange(40) < 20
    split = np.concatenate([dark[:10], bright])
    device, names, out = _adapted(tmp_path, initial, "device", split, np.arange(30) < 10, dark[10:])
    rehearsal, _, _ = _adapted(tmp_path, initial, "rehearsal", x, mask, weight=0.0)
    half, _, _ = _adapted(tmp_path, initial, "half", x, mask, weight=0.5)
    before = bn_statistics(initial[0], names)
    assert len(device) == 4
    means = [name for name in device if "moving_mean" in name]
    for mean in means:
        variance = mean.replace("moving_mean", "moving_variance")
        assert not np.allclose(device[mean], before[mean]), mean
        assert not np.allclose(device[mean], rehearsal[mean]), mean
        np.testing.assert_allclose(half[mean], (device[mean] + rehearsal[mean]) / 2,
                                   rtol=1e-4, atol=1e-5)
        gap = np.square(device[mean] - rehearsal[mean]) / 4
        np.testing.assert_allclose(half[variance],
                                   (device[variance] + rehearsal[variance]) / 2 + gap,
                                   rtol=1e-4, atol=1e-5)
    with np.load(out) as adapted, np.load(initial[0]) as start:
        for i, name in enumerate(names):
            if "moving_" not in name:
                np.testing.assert_array_equal(adapted[f"w{i:04d}"], start[f"w{i:04d}"], name)


def test_auto_batchnorm_mixture_keeps_the_best_weight_that_spares_the_reference(tmp_path, initial):
    # bn_device_share auto: after training, each of AUTO_WEIGHTS is scored on the evaluation
    # set (group 0: the device's validation images, dark; group 2: the reference, bright) and
    # the rule of choose_weight keeps one; the weights written carry that mixture, as a
    # separate evaluate run of them confirms.
    from odtd.trainer.learning.batchnorm import AUTO_WEIGHTS, choose_weight

    rng = np.random.default_rng(5)
    dark = rng.integers(0, 60, (30, *SHAPE), dtype=np.uint8)
    bright = rng.integers(150, 256, (30, *SHAPE), dtype=np.uint8)
    train = tmp_path / "auto-train.npz"
    np.savez(train, x=np.concatenate([dark[:10], bright[:10]]),
             y=rng.integers(0, 3, 20).astype(np.int64), device=np.arange(20) < 10)
    validation = tmp_path / "auto-val.npz"
    np.savez(validation, x=np.concatenate([dark[10:], bright[10:]]),
             y=rng.integers(0, 3, 40).astype(np.int64),
             group=np.repeat(np.array([0, 2], dtype=np.int64), 20))
    out, result, tried, kept, full = _auto(tmp_path, initial, "auto", train, validation,
                                           "bn_device_share", 0.05, batch_size=8,
                                           learning_rate=0.01)
    assert sorted(tried) == list(AUTO_WEIGHTS)
    # Scored lazily: in full only from the best on the device's images down to the one kept.
    assert kept == choose_weight(full, result["by_group_before"]["2"], 0.05, "0", "2")
    assert all((groups["0"], -w) < (tried[kept]["0"], -kept)
               for w, groups in tried.items() if w not in full)
    assert _scored(tmp_path, "auto-check", out, validation) == tried[kept]


def test_a_candidate_refused_on_validation_is_not_scored_on_the_reference(tmp_path, initial,
                                                                         data):
    # The same training twice: with an acceptance test nothing that changes a prediction
    # passes (z 50), the candidate is scored on the validation group alone; with one nothing
    # fails (tolerance 1), on both groups.
    rng = np.random.default_rng(9)
    validation = tmp_path / "two-groups.npz"
    np.savez(validation, x=rng.integers(0, 256, (40, *SHAPE), dtype=np.uint8),
             y=rng.integers(0, 3, 40).astype(np.int64),
             group=np.repeat(np.array([0, 2], dtype=np.int64), 20))
    results = {}
    for name, tolerance, z in (("refused", 0.0, 50.0), ("passed", 1.0, 0.0)):
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(initial[0]), train_data=data["train_data"],
            validation_data=str(validation), learning_rate=0.2, acceptance_tolerance=tolerance,
            confidence_z=z))
        assert code == 0, stderr
        after = [e for e in by_event(events, "eval") if e["phase"] == "after"][0]
        results[name] = events[-1], after
    passed, passed_eval = results["passed"]
    assert set(passed["by_group_after"]) == set(passed["paired_by_group"]) == {"0", "2"}
    assert passed["paired_by_group"]["0"]["gained"] + passed["paired_by_group"]["0"]["lost"] > 0
    assert passed_eval["samples"] == 40
    refused, refused_eval = results["refused"]
    assert set(refused["by_group_after"]) == set(refused["paired_by_group"]) == {"0"}
    assert refused_eval["samples"] == 20 and refused["per_class_after"] is None
    assert refused["accuracy_after"] == refused["by_group_after"]["0"]


def test_device_mask_of_the_wrong_length_is_a_bad_job(tmp_path, data):
    train = tmp_path / "masked.npz"
    x = np.zeros((4, *SHAPE), dtype=np.uint8)
    np.savez(train, x=x, y=np.zeros(4, dtype=np.int64), device=np.ones(3, dtype=bool))
    code, events, _ = run_worker(write_job(tmp_path, train_data=str(train), bn_device_share=0.5))
    assert code == 2 and events[-1]["kind"] == "bad_job"
    assert "device in" in events[-1]["message"] and "4 booleans" in events[-1]["message"]


def test_device_split_measures_at_most_1024_rehearsed_images_spread_over_the_draw(tmp_path):
    from odtd.trainer.worker.data import REHEARSAL_IMAGES, load_device_split

    x = np.zeros((3000, 2, 2, 1), dtype=np.uint8)
    x[:, 0, 0, 0] = np.arange(3000) % 10  # the replay draw's round-robin over 10 classes
    mask = np.arange(3000) < 40
    path = tmp_path / "train.npz"
    np.savez(path, x=x, y=np.zeros(3000, dtype=np.int64), device=mask)
    device, rehearsed, labels = load_device_split(str(path), x, mask)
    assert labels is None  # without y: nothing to weigh the classes by
    assert len(device) == 40 and len(rehearsed) == REHEARSAL_IMAGES == 1024
    assert np.bincount(rehearsed[:, 0, 0, 0]).min() >= 100  # every class, not the first few


def _bands(rng, count):
    """Images whose class is their brightness band (0 dark, 1 mid, 2 bright): easy to learn."""
    labels = np.arange(count) % 3
    x = np.stack([rng.integers(85 * c, 85 * c + 60, SHAPE, dtype=np.uint8) for c in labels])
    return x, labels.astype(np.int64)


def test_distillation_holds_the_served_models_predictions_on_rehearsed_images(tmp_path, initial):
    # A teacher learns the brightness bands. A session then rehearses the same images under
    # labels rotated by one class (and trains on 6 device images): without distillation the
    # candidate follows the new labels; with it, it keeps most of the teacher's predictions.
    # Changed predictions are counted by the worker itself: the validation set holds each
    # rehearsed image three times, once per label, so a prediction that changes is exactly
    # one "lost" in the paired counts against the teacher.
    rng = np.random.default_rng(11)
    x, y = _bands(rng, 24)
    teacher = tmp_path / "teacher.npz"
    np.savez(tmp_path / "bands.npz", x=x, y=y)
    code, _, stderr = run_worker(write_job(
        tmp_path, "teacher", weights_in=str(initial[0]), weights_out=str(teacher), epochs=30,
        batch_size=8, learning_rate=0.05, train_data=str(tmp_path / "bands.npz")))
    assert code == 0, stderr
    device_x, device_y = _bands(rng, 6)
    train = tmp_path / "session.npz"
    np.savez(train, x=np.concatenate([device_x, x]), y=np.concatenate([device_y, (y + 1) % 3]),
             device=np.arange(30) < 6)
    validation = tmp_path / "every-label.npz"
    np.savez(validation, x=np.concatenate([x, x, x]), y=np.repeat(np.arange(3), 24),
             group=np.zeros(72, dtype=np.int64))
    changed = {}
    for weight in (0.0, 1.0):
        code, events, stderr = run_worker(write_job(
            tmp_path, f"distill-{weight:g}", weights_in=str(teacher), epochs=20, batch_size=10,
            learning_rate=0.01, freeze_bn=True, train_data=str(train),
            validation_data=str(validation), distill=weight))
        assert code == 0, stderr
        result = events[-1]
        assert result.get("distill_images") == (24 if weight else None)
        changed[weight] = result["paired_by_group"]["0"]["lost"]
    assert changed[0.0] >= 12  # the rotated labels won without distillation
    assert changed[1.0] <= 3


def _skewed(path, count, seed, share=0.9, device=None):
    """``count`` random images, ``share`` of them class 0, the rest spread over the others."""
    rng = np.random.default_rng(seed)
    y = np.where(rng.random(count) < share, 0, rng.integers(1, len(CLASSES), count))
    x = rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8)
    arrays = {"x": x, "y": y.astype(np.int64)}
    if device is not None:
        arrays["device"] = device
    np.savez(path, **arrays)
    return y


def test_prior_correction_raises_the_devices_accuracy_and_leaves_the_reference_alone(tmp_path, initial):
    # The device sees class 0 nine times in ten; its held-out images too (group 1). The
    # reference (group 2) is evenly mixed. The same job, with the option and without.
    device = np.array([True] * 60 + [False] * 60)
    rng = np.random.default_rng(3)
    train_y = np.concatenate([np.where(rng.random(60) < 0.9, 0, rng.integers(1, 3, 60)),
                              np.arange(60) % 3])  # the rehearsed images: evenly mixed
    np.savez(tmp_path / "train.npz", x=rng.integers(0, 256, (120, 32, 32, 3), dtype=np.uint8),
             y=train_y.astype(np.int64), device=device)
    holdout_y = _skewed(tmp_path / "holdout.npz", 60, seed=4)
    with np.load(tmp_path / "holdout.npz") as held:
        reference_x = np.random.default_rng(5).integers(0, 256, (30, 32, 32, 3), dtype=np.uint8)
        np.savez(tmp_path / "val.npz", x=np.concatenate([held["x"], reference_x]),
                 y=np.concatenate([holdout_y, np.arange(30) % 3]).astype(np.int64),
                 group=np.array([1] * 60 + [2] * 30))
    results = {}
    for on in (True, False):
        name = "on" if on else "off"
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(initial[0]), weights_out=str(tmp_path / f"{name}.npz"),
            epochs=0, train_data=str(tmp_path / "train.npz"), trained_share="auto",
            validation_data=str(tmp_path / "val.npz"), prior_correction=on))
        assert code == 0, stderr
        results[name] = events[-1]
    on, off = results["on"], results["off"]
    assert off["logit_offset_after"] is None and off["priors"] is None
    assert on["priors"]["status"] == "estimated" and on["priors"]["calibrated_on"] == "reference"
    assert on["priors"]["labelled"] == 60
    assert on["priors"]["device"][0] > 0.7  # the labelled images' share of class 0
    offset = on["logit_offset_after"]
    assert len(offset) == len(CLASSES) and np.argmax(offset) == 0
    # The device's images gain (nine in ten are of the class the offset favours); the
    # reference is scored without the offset: as without it. No step is taken (0 epochs), so
    # the gain is the offset's alone, whatever a TensorFlow version's steps would learn.
    assert on["by_group_after"]["1"] >= off["by_group_after"]["1"] + 0.2, (on, off)
    assert on["by_group_after"]["2"] == off["by_group_after"]["2"]
    # Before anything trains, the served weights are scored with the priors estimated anew
    # (``prior_refresh``): here the same weights (0 epochs), so the same offset and scores.
    assert "prior_refresh" not in off
    refresh = on["prior_refresh"]
    np.testing.assert_allclose(refresh["logit_offset"], offset, atol=1e-5)
    assert refresh["by_group"]["1"] == on["by_group_after"]["1"]
    # ``trained_share: auto`` ranks its tries (all the same weights here) under that offset:
    # each scores what the served model with the new priors does, not what it did before.
    assert on["trained_shares_tried"] and all(
        tried["1"] == refresh["by_group"]["1"] for tried in on["trained_shares_tried"].values())
    assert on["by_group_before"]["1"] < refresh["by_group"]["1"]
    # A served version whose offset scores higher than today's estimate: here the day's labels
    # are mostly class 1 while the held-out images stay mostly class 0, and the served offset
    # calls every image class 0. The tries are ranked under it, and the candidate keeps it
    # over its own estimate and today's (the same weights: the same estimate).
    served = [8.0, -4.0, -4.0]
    np.savez(tmp_path / "moved.npz", x=rng.integers(0, 256, (120, 32, 32, 3), dtype=np.uint8),
             y=np.where(device, 1, train_y).astype(np.int64), device=device)
    code, events, stderr = run_worker(write_job(
        tmp_path, "served", weights_in=str(initial[0]), weights_out=str(tmp_path / "served.npz"),
        epochs=0, train_data=str(tmp_path / "moved.npz"), trained_share="auto",
        validation_data=str(tmp_path / "val.npz"), prior_correction=True, logit_offset=served))
    assert code == 0, stderr
    kept = events[-1]
    assert kept["prior_refresh"]["acceptance"]["served"] > kept["prior_refresh"]["acceptance"]["refresh"]
    assert kept["prior_refresh"]["acceptance"]["served"] == round(kept["by_group_before"]["1"], 5)
    assert all(tried["1"] == kept["by_group_before"]["1"]
               for tried in kept["trained_shares_tried"].values())
    assert kept["priors"]["offset"] == "served" and kept["logit_offset_after"] == served
    scored = kept["priors"]["offset_accuracy"]
    # Today's estimate on the served weights is the candidate's own (nothing trained): the same
    # offset, read back rounded, so scored once, as the candidate's.
    assert set(scored) == {"candidate", "served"}
    assert scored["served"] > scored["candidate"]
    # An evaluate job applies a model's offset to the rows its file names.
    rows = np.zeros(90, dtype=bool)
    rows[:60] = True
    with np.load(tmp_path / "val.npz") as val:
        np.savez(tmp_path / "rows.npz", x=val["x"], y=val["y"], group=val["group"], offset=rows)
    code, events, stderr = run_worker(write_job(
        tmp_path, "evaluate", mode="evaluate", weights_in=str(tmp_path / "on.npz"),
        validation_data=str(tmp_path / "rows.npz"), logit_offset=offset))
    assert code == 0, stderr
    assert events[-1]["by_group_after"] == on["by_group_after"]


def test_a_balanced_loss_does_not_learn_the_class_mix(tmp_path, initial):
    # Random images, nine in ten labelled class 0: all a model can learn from them is the
    # mix. Scored on other random images all labelled class 0, the loss is the mean of
    # -log p(class 0): trained plainly (one epoch, a gentle rate, as a session's) the model
    # calls class 0 likelier than it did, toward the mix's 0.9; with the balanced loss its
    # optimum is the even 1/3, and it ends well short of the plain one (tf.keras 2 and
    # Keras 3 start tinycnn elsewhere and move at their own pace; many epochs on few images
    # overfit either way).
    _skewed(tmp_path / "train.npz", 96, seed=11)
    rng = np.random.default_rng(12)
    np.savez(tmp_path / "val.npz", x=rng.integers(0, 256, (90, 32, 32, 3), dtype=np.uint8),
             y=np.zeros(90, np.int64))
    results, losses = {}, {}
    for on in (True, False):
        name = "on" if on else "off"
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(initial[0]), weights_out=str(tmp_path / f"{name}.npz"),
            epochs=1, learning_rate=0.002, train_data=str(tmp_path / "train.npz"),
            validation_data=str(tmp_path / "val.npz"), balanced_loss=on))
        assert code == 0, stderr
        results[name] = events[-1]
        losses[name] = {e["phase"]: e["loss"] for e in by_event(events, "eval")}
    adjustment = results["on"]["balanced_loss"]
    assert len(adjustment) == len(CLASSES) and np.argmax(adjustment) == 0
    assert "balanced_loss" not in results["off"]
    assert losses["on"]["before"] == losses["off"]["before"]
    assert losses["off"]["after"] < losses["off"]["before"] - 0.3, losses
    assert losses["on"]["after"] > losses["off"]["after"] + 0.3, losses


def test_the_entropy_objective_reads_no_label(tmp_path, initial):
    # TENT's objective: the same images under other labels train to the same weights; the
    # labels' cross-entropy does not.
    rng = np.random.default_rng(6)
    x = rng.integers(0, 256, (24, 32, 32, 3), dtype=np.uint8)
    weights = {}
    for objective in ("entropy", "labels"):
        for name, labels in (("a", np.zeros(24)), ("b", np.arange(24) % 3)):
            np.savez(tmp_path / f"{name}.npz", x=x, y=labels.astype(np.int64))
            out = tmp_path / f"{objective}-{name}.npz"
            code, _, stderr = run_worker(write_job(
                tmp_path, f"{objective}-{name}", weights_in=str(initial[0]), weights_out=str(out),
                train_data=str(tmp_path / f"{name}.npz"), epochs=1, objective=objective,
                trainable="batchnorm", optimizer="adam", learning_rate=0.01))
            assert code == 0, stderr
            with np.load(out) as arrays:
                weights[objective, name] = [arrays[key] for key in sorted(arrays.files)]
    assert all(np.array_equal(a, b) for a, b in zip(weights["entropy", "a"], weights["entropy", "b"]))
    assert not all(np.array_equal(a, b) for a, b in zip(weights["labels", "a"], weights["labels", "b"]))


def test_pseudo_labels_add_the_sure_images_without_a_label(tmp_path, initial):
    # A threshold every image passes (three classes: the top probability is at least a third)
    # adds as many as there are labelled device images; a threshold none passes adds none.
    rng = np.random.default_rng(7)
    np.savez(tmp_path / "train.npz", x=rng.integers(0, 256, (30, 32, 32, 3), dtype=np.uint8),
             y=(np.arange(30) % 3).astype(np.int64), device=np.arange(30) < 20,
             unlabelled_x=rng.integers(0, 256, (50, 32, 32, 3), dtype=np.uint8))
    write_samples(tmp_path / "val.npz", 12, seed=8)
    samples = {}
    for name, threshold in (("all", 0.0), ("none", 1.0), ("off", None)):
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(initial[0]), weights_out=str(tmp_path / f"{name}.npz"),
            epochs=1, train_data=str(tmp_path / "train.npz"),
            validation_data=str(tmp_path / "val.npz"), pseudo_labels=threshold))
        assert code == 0, stderr
        samples[name] = (events[-1]["samples"], events[-1].get("pseudo_labels"))
    assert samples["all"][1]["kept"] <= 20 and samples["all"][1]["offered"] == 50
    assert samples["all"][0] == samples["off"][0] + samples["all"][1]["kept"] > samples["off"][0]
    assert samples["none"][1]["kept"] == 0 and samples["none"][0] == samples["off"][0]
    assert samples["off"][1] is None


def test_class_balanced_statistics_weigh_a_rare_class_as_much_as_a_frequent_one(tmp_path, initial):
    # The device saw 36 dark images of class 0 and 4 bright ones of class 1 (class 1 in the
    # earlier days' device_x). Balanced, the first layer's moving mean is the two classes'
    # midpoint; plain, it sits near the dark class's.
    rng = np.random.default_rng(9)
    dark = rng.integers(0, 60, (36, *SHAPE), dtype=np.uint8)
    bright = rng.integers(150, 256, (4, *SHAPE), dtype=np.uint8)
    train = tmp_path / "skewed.npz"
    np.savez(train, x=dark, y=np.zeros(36, np.int64), device=np.ones(36, dtype=bool),
             device_x=bright, device_y=np.ones(4, np.int64))
    means = {}
    for name, balanced in (("balanced", True), ("plain", False), ("dark", None), ("bright", None)):
        path = train
        if balanced is None:  # one class alone, for reference
            path = tmp_path / f"{name}.npz"
            images = dark if name == "dark" else bright
            np.savez(path, x=images, y=np.zeros(len(images), np.int64),
                     device=np.ones(len(images), dtype=bool))
        out = tmp_path / f"{name}-out.npz"
        code, events, stderr = run_worker(write_job(
            tmp_path, name, weights_in=str(initial[0]), weights_out=str(out), epochs=0, batch_size=64,
            freeze_bn=True, train_data=str(path), bn_device_share=1.0,
            bn_class_balanced=bool(balanced)))
        assert code == 0, stderr
        stats = bn_statistics(out, events[-1]["weight_names"])
        means[name] = next(value for key, value in stats.items() if "moving_mean" in key)
    midpoint = (means["dark"] + means["bright"]) / 2
    assert np.allclose(means["balanced"], midpoint, atol=1e-3 * (1 + np.abs(midpoint).max()))
    assert np.abs(means["plain"] - means["dark"]).max() < np.abs(means["balanced"] - means["dark"]).max()
