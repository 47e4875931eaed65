"""The scenarios' draws (odtd.sim.scenario): a device's class mix, runs of one class, unlabelled images."""

from __future__ import annotations

import numpy as np
import pytest

from odtd.errors import ConfigError
from odtd.sim.scenario import Scenario, mixed_sample, stream_draws

LABELS = np.repeat(np.arange(10), 600)  # a data set's split: 600 images of each of 10 classes


def _runs(labels: np.ndarray) -> float:
    """The mean length of the runs of one class in ``labels``."""
    return len(labels) / (1 + int(np.count_nonzero(np.diff(labels))))


@pytest.mark.parametrize("priors, stream, unlabelled, said", [
    ("dirichlet:0", None, 0, "--priors 'dirichlet:0': give dirichlet:NUMBER, the number above 0"),
    ("uniform:1", None, 0, "--priors 'uniform:1'"),
    (None, "runs:0.5", 0, "--stream 'runs:0.5': give runs:NUMBER, the number at least 1"),
    (None, "runs:x", 0, "--stream 'runs:x'"),
    (None, None, -1, "--unlabelled -1: give a number of images"),
])
def test_bad_options_are_refused_in_one_line(priors, stream, unlabelled, said):
    with pytest.raises(ConfigError) as error:
        Scenario.parse(priors, stream, unlabelled)
    assert str(error.value).startswith(said) and "\n" not in str(error.value)


def test_options_parse_and_describe():
    scenario = Scenario.parse("dirichlet:0.3", "runs:16", 512)
    assert scenario == Scenario(0.3, 16.0, 512) and not scenario.even
    assert scenario.describe() == "priors dirichlet:0.3, stream runs:16, 512 unlabelled a day"
    assert Scenario.parse().even and Scenario.parse().describe() == "even"


def test_the_mix_is_fixed_per_seed_and_uneven_for_a_small_alpha():
    uneven = Scenario(priors=0.1)
    assert np.array_equal(uneven.mix(10, 3), uneven.mix(10, 3))
    assert not np.array_equal(uneven.mix(10, 3), uneven.mix(10, 4))
    assert abs(uneven.mix(10, 3).sum() - 1) < 1e-9
    # Alpha 0.1: most of the mass on a few classes; none set: every class alike.
    assert np.mean([np.sort(uneven.mix(10, s))[-2:].sum() for s in range(20)]) > 0.7
    assert np.allclose(Scenario().mix(10, 3), 0.1)


def test_a_stream_follows_the_mix_in_runs_across_days():
    scenario = Scenario(priors=0.5, runs=16, unlabelled=32)
    days = stream_draws(LABELS, 10, 64, scenario, seed=1)
    assert all(len(labelled) == 64 and len(unlabelled) == 32 for labelled, unlabelled in days)
    every = np.concatenate([np.concatenate(day) for day in days])
    assert len(np.unique(every)) == len(every)  # no image twice
    stream = LABELS[np.concatenate([np.concatenate(day) for day in days])]
    share = np.bincount(stream, minlength=10) / len(stream)
    assert np.abs(share - scenario.mix(10, 1)).max() < 0.1  # 960 images of the mix, in runs
    # In runs: the camera's order (labelled and unlabelled of a day together) keeps them.
    ordered = np.sort(np.concatenate(days[0]))  # indices sort by class within LABELS' layout
    assert len(np.unique(LABELS[ordered])) <= 6  # 96 images in runs of 16: a few classes a day
    shuffled = stream_draws(LABELS, 40, 64, Scenario(priors=0.5), seed=1)
    assert _runs(LABELS[np.concatenate([d[0] for d in shuffled])]) < 3


def test_runs_are_of_the_mean_length_asked():
    days = stream_draws(LABELS, 30, 64, Scenario(runs=16), seed=2)
    assert 10 < _runs(LABELS[np.concatenate([labelled for labelled, _ in days])]) < 24
    assert _runs(LABELS[np.concatenate([d[0] for d in stream_draws(LABELS, 30, 64, Scenario(), 2)])]) < 1.5


def test_too_few_images_is_a_clear_error():
    with pytest.raises(ValueError, match="100 days x 96 images need 9600"):
        stream_draws(LABELS[:5000], 100, 64, Scenario(unlabelled=32), seed=0)


def test_a_mixed_sample_has_the_mix_counts():
    mix = np.array([0.5, 0.25, 0.125, 0.125] + [0.0] * 6)
    picked = mixed_sample(LABELS, 200, mix, seed=0, exclude=range(100))
    assert np.array_equal(np.bincount(LABELS[picked], minlength=10), [100, 50, 25, 25] + [0] * 6)
    assert not set(picked) & set(range(100))


def test_odtctl_simulates_a_devices_mix_and_runs_from_a_labelled_set(tmp_path):
    from conftest import odtctl

    from odtd.sim import datasets
    from odtd.sim.simulate import DataSource, SimulationOptions

    for split, seed in (("train", 1), ("test", 2)):
        x, y = datasets.synthetic(400, "server", seed=seed)
        datasets.write_image_folder(x, y, datasets.CLASSES, tmp_path / "set" / split)
    common = dict(dataset=str(tmp_path / "set"), per_day=16, pretrain_samples=20, seed=4)
    source = DataSource(SimulationOptions(priors="dirichlet:0.1", stream="runs:8", **common))
    labels = np.array([label for _, label in source.dataset.files("train")])
    days = [labels[source._day_indices(day)[0]] for day in range(4)]
    assert all(len(day) == 16 for day in days)
    stream = np.concatenate(days)
    assert np.sort(np.bincount(stream, minlength=10))[-2:].sum() >= 0.6 * len(stream)  # a few classes
    assert _runs(stream) > 3  # in runs
    # Day 2's draw does not depend on how many days were drawn before it.
    assert np.array_equal(source._day_indices(2)[0], DataSource(SimulationOptions(
        priors="dirichlet:0.1", stream="runs:8", **common))._day_indices(2)[0])
    even = DataSource(SimulationOptions(**common))
    assert np.bincount(np.concatenate([labels[even._day_indices(d)[0]] for d in range(4)]),
                       minlength=10).max() <= 8  # 64 images, every class 6 or 7 times
    with pytest.raises(ConfigError, match="--priors, --stream and --unlabelled draw a device's days"):
        DataSource(SimulationOptions(priors="dirichlet:0.1"))
    # K more images a day without labels, of the same stream: written as an _unlabelled/ folder.
    more = DataSource(SimulationOptions(priors="dirichlet:0.1", stream="runs:8", unlabelled=24, **common))
    labelled, unlabelled = more._day_indices(1)
    assert len(labelled) == 16 and len(unlabelled) == 24 and not set(labelled) & set(unlabelled)
    more.write_day(1, 0, tmp_path / "day")
    assert len(list((tmp_path / "day" / "_unlabelled").iterdir())) == 24
    assert sum(len(list(folder.iterdir())) for folder in (tmp_path / "day").iterdir()
               if folder.name != "_unlabelled") == 16
    refused = odtctl("simulate", "--priors", "uniform", home=tmp_path / "home", check=False)
    assert refused.returncode != 0 and "--priors 'uniform': give dirichlet:NUMBER" in refused.stderr
    assert not (tmp_path / "home").exists()


def test_a_stream_can_follow_the_mix_of_another_seed():
    # Runs of other draws of one device: the draws differ, the mix (its test images') does not.
    y = np.repeat(np.arange(10), 300)
    scenario = Scenario.parse("dirichlet:0.3", None)
    mix = scenario.mix(10, 0)
    for seed in (5, 6):
        draws = stream_draws(y, 4, 200, scenario, seed, mix_seed=0)
        seen = np.bincount(y[np.concatenate([day for day, _ in draws])], minlength=10) / 800
        assert np.abs(seen - mix).sum() < 0.25, (seen, mix)
