"""One Flower round on a device, without Flower: the global weights to a session and back.

The ClientApp (``client``) hands the round's arrays here; they are written as a weights file in
``HOME/run/fleet``, the daemon is asked over its control socket for a federated session
(``odtd.session.federated``), and the trained weights come back with the same metric keys every
round. Whatever keeps the device from training (a closed gate, a spent energy budget, a memory
cap that admits nothing, a session already running, weights that do not fit) raises
``Declined`` with the daemon's reason, which the ClientApp turns into Flower's error reply.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from odtd import atomic
from odtd.daemon.control import request_federated_evaluate, request_federated_session
from odtd.errors import OdtdError
from odtd.fleet.packing import pack, unpack
from odtd.session.federated import EXCHANGE_DIR, read_weights, write_weights

# The reply's metrics, the same keys every round (Flower's aggregation requires it). The
# accuracies are on the device's own held-out samples where it has them, else on its
# evaluation set (``details.evaluation_set``); NaN where the session measured nothing.
# ``seconds`` is the session's; ``device-seconds`` the whole of the device's part (the weights
# written, the session asked for and run, its weights read back): what Flower does around it
# (messaging, the ClientApp's process, aggregation) is the rest of the round.
METRIC_KEYS = ("num-examples", "accuracy-before", "accuracy-after", "joules", "peak-memory-mb",
               "seconds", "device-seconds", "served")


class Declined(Exception):
    """The device does not take this round; the message says why (the daemon's words)."""


def _number(value: Optional[float]) -> float:
    return float("nan") if value is None else float(value)


def round_metrics(session: Dict[str, Any], device_seconds: float = float("nan")) -> Dict[str, float]:
    """A federated session object's reply metrics (``METRIC_KEYS``)."""
    details = session.get("details") or {}
    holdout = details.get("holdout_accuracy_before") is not None
    before = details.get("holdout_accuracy_before") if holdout else session.get("accuracy_before")
    after = details.get("holdout_accuracy_after") if holdout else session.get("accuracy_after")
    return {
        "num-examples": int((session.get("samples_new") or 0) + (session.get("samples_replay") or 0)),
        "accuracy-before": _number(before), "accuracy-after": _number(after),
        "joules": _number(session.get("energy_j")),
        "peak-memory-mb": _number(session.get("peak_memory_mb")),
        "seconds": _number(session.get("duration_s")),
        "device-seconds": float(device_seconds),
        "served": 1.0 if session.get("outcome") == "promoted" else 0.0,
    }


def write_global(path: Path, arrays: List[np.ndarray], layout: Optional[List[str]]) -> None:
    """Write a round's global weights (packed where ``layout`` is given) as a weights file.

    Raises:
        OdtdError: packed weights that do not fit their layout.
    """
    if layout:
        arrays = unpack(arrays, list(layout))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_weights(path, arrays)


def exchange_file(exchange: Path, run_id: str, server_round: int, kind: str) -> Path:
    """This ClientApp's weights file of a round: named per process (``atomic.temporary_name``).

    Two ClientApps asking one daemon at once (two SuperNodes pointed at one socket) never share
    a file, and neither clears the other's (``clear_exchange``).
    """
    return Path(atomic.temporary_name(exchange / f"{run_id}-{server_round}-{kind}.npz"))


def clear_exchange(exchange: Path) -> None:
    """Remove the weights files that ClientApps no longer running left in ``exchange``.

    A round's files go when its ClientApp ends; a ClientApp killed with its SuperNode leaves
    them, and its session, still running in the daemon, hands its weights back after it. A
    file of a living process (``atomic.is_abandoned``) is another ClientApp's.
    """
    for stale in Path(exchange).glob("*.npz"):
        if not atomic.is_temporary(stale.name) or atomic.is_abandoned(stale.name):
            stale.unlink(missing_ok=True)


def train_round(socket_path: Path, run_id: str, server_round: int, arrays: List[np.ndarray],
                config: Dict[str, Any]) -> Tuple[List[np.ndarray], Dict[str, float]]:
    """Run one round's federated session on the device behind ``socket_path``.

    Args:
        socket_path: The daemon's control socket (``HOME/run/odtd.sock``).
        run_id: Flower's run id.
        server_round: The round's number.
        arrays: The global weights: packed (``packing``) where ``config`` has a ``layout``,
            else in the model's order (``w0000``...).
        config: The round's settings: ``layout``, ``local-epochs``, ``learning-rate``,
            ``batchnorm`` and, from FedProx, ``proximal-mu``.

    Returns:
        The trained weights (packed as they came) and the reply's metrics.

    Raises:
        Declined: The device did not train (why, in the daemon's words).
    """
    started = time.monotonic()
    exchange = Path(socket_path).parent / EXCHANGE_DIR
    weights_in = exchange_file(exchange, run_id, server_round, "global")
    weights_out = exchange_file(exchange, run_id, server_round, "trained")
    layout = config.get("layout")
    clear_exchange(exchange)
    try:
        write_global(weights_in, arrays, layout)
        epochs, rate = config.get("local-epochs"), config.get("learning-rate")
        session = request_federated_session(Path(socket_path), {
            "run_id": str(run_id), "round": int(server_round), "weights_in": str(weights_in),
            "weights_out": str(weights_out), "epochs": int(epochs) if epochs else None,
            "learning_rate": float(rate) if rate and not math.isnan(float(rate)) else None,
            "batchnorm": str(config.get("batchnorm") or "fedavg"),
            "proximal_mu": float(config.get("proximal-mu") or 0.0)})
        handed_back = ((session.get("details") or {}).get("federated") or {}).get("handed_back")
        if not handed_back:
            raise Declined(f"session {session.get('id')} {session.get('outcome')}: "
                           f"{session.get('reason')}")
        trained = read_weights(weights_out)
        if layout:
            trained = pack(trained)[0]
        return trained, round_metrics(session, time.monotonic() - started)
    except (OdtdError, OSError) as exc:
        raise Declined(str(exc)) from None
    finally:
        for path in (weights_in, weights_out):
            path.unlink(missing_ok=True)


# An evaluate round's reply: the round's model on the device's own set (the same keys always).
EVALUATE_KEYS = ("num-examples", "accuracy", "validation-accuracy", "holdout-accuracy",
                 "reference-accuracy", "device-seconds")


def evaluate_round(socket_path: Path, run_id: str, server_round: int, arrays: List[np.ndarray],
                   config: Dict[str, Any]) -> Dict[str, float]:
    """Score one round's global weights on the device behind ``socket_path``; nothing trains.

    Args and packing as ``train_round``.

    Returns:
        ``EVALUATE_KEYS``: the held-out samples' count (FedAvg's weight) and the accuracies.

    Raises:
        Declined: The device did not evaluate (why, in the daemon's words).
    """
    exchange = Path(socket_path).parent / EXCHANGE_DIR
    weights_in = exchange_file(exchange, run_id, server_round, "evaluate")
    clear_exchange(exchange)
    try:
        write_global(weights_in, arrays, config.get("layout"))
        result = request_federated_evaluate(Path(socket_path), {
            "run_id": str(run_id), "round": int(server_round), "weights_in": str(weights_in),
            "weights_out": str(weights_in), "batchnorm": str(config.get("batchnorm") or "fedavg")})
        return {key: float(result.get(key, float("nan"))) for key in EVALUATE_KEYS}
    except (OdtdError, OSError) as exc:
        raise Declined(str(exc)) from None
    finally:
        weights_in.unlink(missing_ok=True)
