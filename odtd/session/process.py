"""A session in this process: its own telemetry sampler, and signals that stop it cleanly.

``odtctl train-now --foreground`` and the daemon's session process (``odtd.daemon.tasks``) run
sessions this way: SIGINT or SIGTERM stops the worker at its next step boundary and the session
ends ``interrupted`` with the reason, never torn.
"""

from __future__ import annotations

import signal
from typing import Callable, Optional

from odtd.home.paths import Home
from odtd.policy import load_policy
from odtd.session.federated import FederatedRound
from odtd.session.gates import StopRequest
from odtd.session.runner import SessionRunner
from odtd.store.records import SessionRecord
from odtd.telemetry.meter import SessionEnergyMeter, running_sampler


def run_session_here(home: Home, trigger: str, day: Optional[str] = None, force: bool = False,
                     progress: Optional[Callable[[str], None]] = None,
                     stop_reason: str = "stopped by {signal}",
                     federated: Optional[FederatedRound] = None) -> SessionRecord:
    """Run one session in this process tree and return its record.

    Args:
        home: the state directory (its ``odtd.yaml`` and policy are read now).
        trigger: what started it (cli, schedule, socket).
        day: YYYY-MM-DD the session belongs to (default: today).
        force: bypass the policy's gates.
        progress: called with one-line progress messages.
        stop_reason: the reason a signal gives the session; ``{signal}`` is its name.
        federated: a Flower round's session (``SessionRunner.run``).
    """
    store = home.open_store()
    stop = StopRequest()

    def request_stop(signum: int, _frame: object) -> None:
        stop.request(stop_reason.format(signal=signal.Signals(signum).name))

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        config = home.load_config()
        policy = load_policy(home.policy_path(config))
        with running_sampler(config.telemetry) as sampler:
            runner = SessionRunner(home, store, config, policy, progress=progress,
                                   energy_meter=SessionEnergyMeter(sampler))
            return runner.run(trigger=trigger, day=day, stop=stop, force=force, federated=federated)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        store.close()
