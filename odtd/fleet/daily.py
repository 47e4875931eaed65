"""Every day's served model of a ``fleet simulate`` run, scored: did a device ever serve below day 0?

``fleet simulate`` scores each arm once, at the end. The issue's guard goal is about every day:
no device ever serves a model below its day 0, on its own images or on clean ones. The run's
homes keep every version and every session row, and its test sets can be drawn again from its
options (``simulate.device_tests``: drawn first, per seed). So after a run, for each device and
each session arm (the fleet's home, the device alone), the version served at the end of each day
is scored on that device's test images; a version is scored once (``ScoringSets`` caches by
content).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from odtd.home.paths import Home
from odtd.home.spec import ModelSpec
from odtd.home.versions import ModelRepo
from odtd.policy import load_policy
from odtd.sim.arms import Trial
from odtd.sim.simulate import DataSource

ARMS = ("fleet", "alone")  # the arms whose homes serve a model day by day


def served_by_day(home: Home, days: int) -> List[Optional[int]]:
    """The version ``home`` served at the end of each of its first ``days`` days.

    Day ``d`` is the home's ``d``-th session (one a day: the fleet's rounds, the alone arm's
    sessions); a promoted session serves its candidate, any other keeps what was served.
    None for a day without a session (a device that never reached its daemon that day).
    """
    store = home.open_store()
    try:
        sessions = sorted(store.sessions(limit=10 * days + 10, done_only=True), key=lambda s: s.id)
    finally:
        store.close()
    served: List[Optional[int]] = []
    current: Optional[int] = 0
    for session in sessions[:days]:
        if session.outcome == "promoted" and session.model_version_after is not None:
            current = session.model_version_after
        elif session.model_version_before is not None:
            current = session.model_version_before
        served.append(current)
    return served + [None] * (days - len(served))


def score_days(out: Path, options: Any, progress: Callable[[str], None] = print,
               tests: Optional[List[Any]] = None) -> Dict[str, Any]:
    """Score every day's served model of each device's fleet and alone homes in run ``out``.

    Args:
        out: The run's directory (``fleet simulate --out``).
        options: The run's ``FleetSimulation`` (the same as it ran with).
        progress: Called with a line per device, and the scoring's own lines.
        tests: The devices' ``ScoringSets`` where the run has them still (``simulate_fleet``:
            what it scored at the end is not scored again); None: drawn again.

    Returns:
        ``devices``: per device, ``base`` (its day 0) and per arm a list of days, each with the
        version and its accuracy per domain; ``below_day0``: ``[device, arm, day, domain]`` for
        every day a served model scored below day 0.
    """
    from odtd.fleet.simulate import DevicePools, device_tests

    base = Home(out / "base")
    store = base.open_store()
    try:
        spec = ModelSpec.from_store(store)
    finally:
        store.close()
    if tests is None:
        source = DataSource(options.each)
        trial = Trial(spec.name, source.classes, spec.input_shape,
                      load_policy(base.policy_path(base.load_config())).training.precision,
                      out / "work-days", log=progress, model_keys=spec.job_keys(base))
        trial.work.mkdir(exist_ok=True)
        pools = DevicePools(options, source)
        tests = [device_tests(options, source, pools, trial, i)  # in the run's order
                 for i in range(options.devices)]
    days = options.each.days
    rows, below = [], []
    for i, sets in enumerate(tests):
        day0 = sets.score(ModelRepo(base.models, spec.name).weights_path(0), full=True).accuracy()
        row: Dict[str, Any] = {"device": i, "base": day0}
        for arm in ARMS:
            home = Home(out / f"{arm}-{i}")
            repo = ModelRepo(home.models, spec.name)
            row[arm] = []
            for day, version in enumerate(served_by_day(home, days), start=1):
                if version is None:
                    row[arm].append({"day": day, "version": None, "accuracy": None})
                    continue
                accuracy = sets.score(repo.weights_path(version), full=True).accuracy()
                row[arm].append({"day": day, "version": version, "accuracy": accuracy})
                below += [[i, arm, day, domain] for domain, value in accuracy.items()
                          if value < day0[domain]]
        rows.append(row)
        progress(f"device {i}: fleet served v{', v'.join(str(d['version']) for d in row['fleet'])}")
    return {"devices": rows, "below_day0": below}
