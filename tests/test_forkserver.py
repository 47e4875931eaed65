"""Workers forked from a server that imported TensorFlow once: the same job, the same worker.

The server and the workers are real processes; TensorFlow is imported only in them.
"""

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, listening, start_server, wait_for
from test_worker import worker_command, write_job, write_samples

from odtd.atomic import pid_alive
from odtd.trainer.worker.forkserver import SERVER_VARIABLE

pytestmark = pytest.mark.trains


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The suite's worker server, or where it is off this module's own; listening once the
    fixture returns."""
    shared = os.environ.get(SERVER_VARIABLE)
    if shared:
        assert listening(shared), (Path(shared).parent / "server.log").read_text()
        yield Path(shared)
        return
    directory = tmp_path_factory.mktemp("forkserver")
    path = directory / "sock"
    process = start_server(directory, environment())
    assert listening(path), (directory / "server.log").read_text()
    yield path
    process.terminate()
    assert process.wait(timeout=60) == 0


def environment(server_path=None, **extra):
    env = {k: v for k, v in os.environ.items() if k != SERVER_VARIABLE}
    if server_path is not None:
        env[SERVER_VARIABLE] = str(server_path)
    env.update(extra)
    return env


def start(job: Path, env) -> subprocess.Popen:
    return subprocess.Popen(worker_command(job), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO, env=env, start_new_session=True)


def events_until(process: subprocess.Popen, name: str) -> list:
    events = []
    for line in process.stdout:
        events.append(json.loads(line))
        if events[-1]["event"] == name:
            return events
    raise AssertionError(f"no {name} event; stderr:\n{process.stderr.read()[-3000:]}")


def gone_within(pid: int, seconds: float) -> bool:
    return wait_for(lambda: not pid_alive(pid), seconds, interval_s=0.05)


def test_a_forked_worker_trains_as_a_fresh_one(server, tmp_path):
    train = write_samples(tmp_path / "train.npz", 24, seed=1)
    validation = write_samples(tmp_path / "val.npz", 12, seed=2)
    runs = {}
    for way, env in (("fresh", environment()), ("forked", environment(server))):
        out = tmp_path / f"{way}.npz"
        job = write_job(tmp_path, name=way, train_data=train, validation_data=validation,
                        weights_out=str(out))
        process = start(job, env)
        stdout, stderr = process.communicate(timeout=240)
        assert process.returncode == 0, stderr[-3000:]
        events = [json.loads(line) for line in stdout.splitlines()]
        with np.load(out) as arrays:
            runs[way] = (process.pid, events, [arrays[key] for key in sorted(arrays.files)])
    for way, (pid, events, _) in runs.items():
        # A fork has a pid of its own; a fresh worker is the process that was started.
        assert (events[0]["event"], events[0]["pid"] == pid) == ("start", way == "fresh")
    fresh, forked = runs["fresh"][1], runs["forked"][1]
    assert [e["event"] for e in fresh] == [e["event"] for e in forked]
    assert [e["loss"] for e in fresh if e["event"] == "step"] == \
        [e["loss"] for e in forked if e["event"] == "step"]
    assert fresh[-1]["accuracy_after"] == forked[-1]["accuracy_after"]
    assert all(np.array_equal(a, b) for a, b in zip(runs["fresh"][2], runs["forked"][2]))


def test_the_stand_in_passes_on_a_stop_request_and_ends_as_its_worker(server, tmp_path):
    train = write_samples(tmp_path / "train.npz", 24)
    job = write_job(tmp_path, train_data=train, epochs=100_000)
    stopped = start(job, environment(server))
    fork = events_until(stopped, "step")[0]["pid"]
    assert fork != stopped.pid
    stopped.send_signal(signal.SIGUSR1)  # stop at the next step boundary
    rest, stderr = stopped.communicate(timeout=60)
    assert stopped.returncode == 0, stderr[-3000:]
    assert json.loads(rest.splitlines()[-1])["status"] == "interrupted"

    terminated = start(job, environment(server))
    fork = events_until(terminated, "step")[0]["pid"]
    terminated.send_signal(signal.SIGTERM)
    terminated.communicate(timeout=60)
    assert terminated.returncode == -signal.SIGTERM  # as the fork ended, passed on
    assert gone_within(fork, 10)


def test_a_fork_killed_as_by_the_oom_killer_ends_its_stand_in_so_too(server, tmp_path):
    train = write_samples(tmp_path / "train.npz", 24)
    process = start(write_job(tmp_path, train_data=train, epochs=100_000), environment(server))
    fork = events_until(process, "step")[0]["pid"]
    os.kill(fork, signal.SIGKILL)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL  # what launch reads an OOM kill from


def test_a_killed_stand_in_takes_its_worker_with_it(server, tmp_path):
    train = write_samples(tmp_path / "train.npz", 24)
    process = start(write_job(tmp_path, train_data=train, epochs=100_000), environment(server))
    fork = events_until(process, "step")[0]["pid"]
    process.kill()
    process.wait(timeout=10)
    assert gone_within(fork, 10), "the fork outlived the process that started it"


def test_a_worker_whose_parent_is_gone_exits_3_from_the_fork_too(server, tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    job = write_job(tmp_path, mode="init", weights_out=str(tmp_path / "w.npz"),
                    parent_pid=gone.pid)
    process = start(job, environment(server))
    stdout, stderr = process.communicate(timeout=60)
    assert (process.returncode, stdout) == (3, "")
    assert "parent" in stderr and "is gone" in stderr


def test_a_worker_with_another_tensorflow_environment_runs_itself(server, tmp_path):
    job = write_job(tmp_path, mode="init", weights_out=str(tmp_path / "w.npz"))
    process = start(job, environment(server, TF_ENABLE_ONEDNN_OPTS="0"))
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr[-3000:]
    assert json.loads(stdout.splitlines()[0])["pid"] == process.pid
    assert "cannot run this job (another environment for TensorFlow (TF_ENABLE_ONEDNN_OPTS))" \
        in stderr


def test_a_worker_with_no_server_listening_runs_itself(tmp_path):
    job = write_job(tmp_path, mode="init", weights_out=str(tmp_path / "w.npz"))
    process = start(job, environment(tmp_path / "no-such-socket"))
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr[-3000:]
    assert json.loads(stdout.splitlines()[0])["pid"] == process.pid
    assert (tmp_path / "w.npz").exists()
