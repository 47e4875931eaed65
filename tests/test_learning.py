"""Replay plus guarded promotion against plain fine-tuning, with tinycnn on the synthetic drift data."""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from odtd import datasets
from odtd.config import Config
from odtd.home import Home
from odtd.ingest import Ingestor, discover
from odtd.models import ModelRepo, file_sha256
from odtd.policy import load_policy
from odtd.runner import run_job
from odtd.session import SessionRunner
from odtd.setup_home import init_home
from odtd.simulate import DataSource, SimulationOptions, pretrain_base

DAYS = 3


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tinycnn home pre-trained on server images; its fixed validation set is server images too."""
    root = tmp_path_factory.mktemp("learning")
    home = Home(root / "home")
    options = SimulationOptions(model="tinycnn", pretrain_samples=1500, pretrain_epochs=6)
    init_home(home, "tinycnn", list(datasets.CLASSES),
              validation_arrays=datasets.synthetic(400, "server", seed=77))
    pretrain_base(home, DataSource(options), options, lambda message: None)
    shutil.copyfile(REPO / "policies" / "tinycnn-test.yaml", home.root / "policy.yaml")
    return home


def _copy(home: Home, tmp_path: Path) -> Home:
    target = tmp_path / "home"
    shutil.copytree(home.root, target)
    return Home(target)


def _evaluate(weights: Path, data: Path, tmp: Path) -> float:
    job = {"protocol": 1, "mode": "evaluate", "model": "tinycnn", "classes": list(datasets.CLASSES),
           "input_shape": [32, 32, 3], "weights_in": str(weights), "validation_data": str(data),
           "batch_size": 100}
    result, _, _ = run_job(Config().trainer.command(), job, tmp)
    return result["accuracy_after"]


def test_guarded_replay_keeps_base_accuracy_while_plain_fine_tuning_forgets(pretrained, tmp_path):
    home = _copy(pretrained, tmp_path)
    store = home.open_store()
    runner = SessionRunner(home, store, Config(), load_policy(home.root / "policy.yaml"))
    ingestor = Ingestor(home, store, list(datasets.CLASSES), (32, 32))
    repo = ModelRepo(home.models, "tinycnn")
    plain = tmp_path / "plain.npz"
    shutil.copyfile(repo.weights_path(repo.current()), plain)
    validation = home.validation_file()
    start = _evaluate(plain, validation, tmp_path / "e0")
    tolerance = 0.01
    for day in range(DAYS):
        x, y = datasets.synthetic(64, "device", seed=500 + day)
        with tempfile.TemporaryDirectory() as tmp:
            datasets.write_image_folder(x, y, datasets.CLASSES, Path(tmp), start_index=day * 64)
            ingestor.ingest(discover(Path(tmp), None), day=f"2026-01-0{day + 1}")
            np.savez(Path(tmp) / "day.npz", x=x, y=y)
            session = runner.run(trigger="simulate", day=f"2026-01-0{day + 1}")
            assert session["outcome"] in ("promoted", "rolled_back")
            if session["outcome"] == "promoted":
                assert session["accuracy_after"] >= session["accuracy_before"] - tolerance
            # Plain fine-tuning: every image, BatchNorm trained, no replay, no guard.
            job = {"protocol": 1, "mode": "train", "model": "tinycnn",
                   "classes": list(datasets.CLASSES), "input_shape": [32, 32, 3],
                   "weights_in": str(plain), "weights_out": str(Path(tmp) / "next.npz"),
                   "train_data": str(Path(tmp) / "day.npz"), "batch_size": 4, "epochs": 3,
                   "optimizer": "sgd", "learning_rate": 0.05, "momentum": 0.9, "seed": day}
            run_job(Config().trainer.command(), job, Path(tmp) / "job")
            shutil.move(Path(tmp) / "next.npz", plain)
    guarded = _evaluate(repo.weights_path(repo.current()), validation, tmp_path / "e1")
    forgot = _evaluate(plain, validation, tmp_path / "e2")
    store.close()
    print(f"base-validation accuracy: start {start:.3f}, guarded {guarded:.3f}, plain {forgot:.3f}")
    assert start > 0.3  # the pre-trained model is far above chance on its own domain
    assert guarded >= start - DAYS * tolerance
    assert forgot < start - 0.05, (start, guarded, forgot)


def test_worse_candidate_is_rolled_back_and_current_unchanged(pretrained, tmp_path):
    home = _copy(pretrained, tmp_path)
    policy = (home.root / "policy.yaml").read_text()
    policy = policy.replace("optimizer: sgd", "optimizer: adam").replace(
        "learning_rate: 0.01", "learning_rate: 5.0").replace("freeze_bn: true", "freeze_bn: false")
    (home.root / "policy.yaml").write_text(policy)
    store = home.open_store()
    repo = ModelRepo(home.models, "tinycnn")
    current, sha = repo.current(), file_sha256(repo.weights_path(repo.current()))
    x, y = datasets.synthetic(64, "device", seed=900)
    datasets.write_image_folder(x, y, datasets.CLASSES, tmp_path / "imgs")
    Ingestor(home, store, list(datasets.CLASSES), (32, 32)).ingest(discover(tmp_path / "imgs", None))
    session = SessionRunner(home, store, Config(), load_policy(home.root / "policy.yaml")).run()
    assert session["outcome"] == "rolled_back", session["reason"]
    assert session["accuracy_after"] < session["accuracy_before"] - 0.01
    assert repo.current() == current and file_sha256(repo.weights_path(current)) == sha
    assert session["model_version_after"] == current
    # The day's samples still enter the replay buffer, to be rehearsed later.
    assert session["details"]["replay_buffer"]["added"] == session["samples_new"]
    store.close()
