"""Power loss at any point, a few kill points of each operation (scripts/bench_power_loss.py
runs 200 and more of each): the ingest, a session, the promotion and an export are SIGKILLed
at write points and at random moments, or have a write fail (ENOSPC, EIO), and the home keeps
its invariants (scripts/power_loss.py: ``check_home`` and each operation's own)."""

import sys

import pytest
from conftest import REPO, built_once, forked_python, odtctl, write_images

sys.path.insert(0, str(REPO / "scripts"))
import power_loss  # noqa: E402

# Kill points per operation here: a sample of the write points in each mode, and random moments.
BUDGET = {"ingest": 8, "session": 4, "promotion": 4, "export": 8}


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    """The home every run starts from: one session done, pending samples, a day in its inbox."""
    return built_once(tmp_path_factory, "power-loss",
                      lambda root: power_loss.make_template(root, odtctl, write_images))


def forked(args, env, timeout_s):
    """``python ARGS`` forked from the tests' ``cli`` server (odtd's imports done once)."""
    return forked_python("cli", *args, env=env, timeout=timeout_s)


@pytest.mark.trains
@pytest.mark.parametrize("operation", power_loss.OPERATIONS)
def test_killed_or_failed_at_any_write_the_home_keeps_its_invariants(operation, template, tmp_path):
    scenario = power_loss.Scenario(template, tmp_path, runner=forked)
    result = power_loss.kill_points(scenario, operation, BUDGET[operation], seed=len(operation))
    assert result["kills_at_writes"] and result["failures_at_writes"] and \
        result["kills_at_random_moments"]
    assert result["violations"] == [], result
