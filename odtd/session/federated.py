"""A federated session's start: the round's global weights, checked, as a session's ``weights_in``.

A Flower SuperNode beside the daemon (``odtd.fleet.client``, docs/fleet.md) asks the daemon over
the control socket for a federated session (op ``federated-session``). It is a local session
(``SessionRunner``: lock, gates, budget, admission, the worker, replay, records, the promotion
guard) that trains from the round's global weights instead of the served model's, and hands
the trained weights back. This module holds what differs: the round's identity and settings
(``FederatedRound``), the check of the weights the server sent against the served model's
(``check_global_weights``: same arrays, shapes and dtypes, all finite) and the device's choice
of BatchNorm parameters (``batchnorm``: ``fedavg`` takes the server's, ``fedbn`` keeps the
device's own, as FedBN does).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional

import numpy as np

from odtd.errors import OdtdError
from odtd.home.versions import ModelRepo

BATCHNORM_CHOICES = ("fedavg", "fedbn")
EXCHANGE_DIR = "fleet"  # under HOME/run: the weights the SuperNode's ClientApp and a session swap
TRAINED_WEIGHTS = "trained.npz"  # a federated session's trained weights before trained_share's average
_STATISTICS = ("moving_mean", "moving_variance")


@dataclass
class FederatedRound:
    """One round's request, as the control socket carries it (``args`` of ``federated-session``).

    Attributes:
        run_id: Flower's run id.
        round: The server's round number (from 1).
        weights_in: The round's global weights (``w0000``... as a version's ``weights.npz``),
            written by the ClientApp in ``HOME/run/fleet``.
        weights_out: Where the trained weights go (in ``HOME/run/fleet``), for the ClientApp.
        epochs: Local epochs the server asks for (None: the policy's admission decides).
        learning_rate: The server's learning rate (None: the policy's).
        batchnorm: ``fedavg`` (train from the server's BatchNorm parameters) or ``fedbn`` (keep
            the served model's: each device its own statistics and scales).
        proximal_mu: FedProx's weight of the proximal term ``(mu / 2) * ||w - w_global||^2``
            in the device's loss (0 or None: none, FedAvg's local training).
    """

    run_id: str
    round: int
    weights_in: str
    weights_out: str
    epochs: Optional[int] = None
    learning_rate: Optional[float] = None
    batchnorm: str = "fedavg"
    proximal_mu: Optional[float] = None

    @classmethod
    def from_args(cls, args: Dict[str, Any], exchange: Path) -> FederatedRound:
        """Read the socket request's ``args``; paths must lie in ``exchange`` (``HOME/run/fleet``).

        Raises:
            OdtdError: A missing or malformed field (one line naming it).
        """
        try:
            federated = cls(run_id=str(args["run_id"]), round=int(args["round"]),
                            weights_in=str(args["weights_in"]), weights_out=str(args["weights_out"]),
                            epochs=None if args.get("epochs") is None else int(args["epochs"]),
                            learning_rate=None if args.get("learning_rate") is None
                            else float(args["learning_rate"]),
                            batchnorm=str(args.get("batchnorm") or "fedavg"),
                            proximal_mu=None if args.get("proximal_mu") is None
                            else float(args["proximal_mu"]))
        except KeyError as exc:
            raise OdtdError(f"federated-session: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise OdtdError(f"federated-session: bad field value ({exc})") from None
        if federated.batchnorm not in BATCHNORM_CHOICES:
            raise OdtdError(f"federated-session: batchnorm {federated.batchnorm!r} is not one of "
                            f"{', '.join(BATCHNORM_CHOICES)}")
        if federated.epochs is not None and federated.epochs < 1:
            raise OdtdError(f"federated-session: epochs {federated.epochs} must be at least 1")
        if federated.proximal_mu is not None and not federated.proximal_mu >= 0:
            raise OdtdError(f"federated-session: proximal_mu {federated.proximal_mu} must be >= 0")
        if federated.learning_rate is not None and not federated.learning_rate > 0:
            raise OdtdError(f"federated-session: learning_rate {federated.learning_rate} must be > 0")
        for name in ("weights_in", "weights_out"):
            path = Path(getattr(federated, name)).resolve()
            if path.parent != exchange.resolve():
                # The socket is the odtd group's; still, a session reads and writes only there.
                raise OdtdError(f"federated-session: {name} {path} is not in {exchange}")
        return federated

    def to_details(self) -> Dict[str, Any]:
        """The session row's ``details.federated``: run, round and what the server asked."""
        data = asdict(self)
        del data["weights_in"], data["weights_out"]
        return data


def _arrays(path: Path, what: str) -> Dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except FileNotFoundError:
        raise OdtdError(f"{what} {path}: no such file") from None
    except (OSError, ValueError, EOFError) as exc:
        raise OdtdError(f"{what} {path}: not a readable .npz of arrays ({exc})") from None


def read_weights(path: Path) -> List[np.ndarray]:
    """A weights file (``w0000``... as a version's ``weights.npz``) as the model's list of arrays."""
    with np.load(path, allow_pickle=False) as data:
        return [data[f"w{i:04d}"] for i in range(len(data.files))]


def write_weights(path: Path, arrays: List[np.ndarray]) -> None:
    """Write the model's list of arrays as a weights file (``read_weights``' format)."""
    np.savez(path, **{f"w{i:04d}": array for i, array in enumerate(arrays)})


def check_global_weights(path: Path, served: Path,
                         expected: Optional[Dict[str, np.ndarray]] = None) -> Dict[str, np.ndarray]:
    """The round's weights, if they fit the served model: same arrays, shapes, dtypes, finite.

    ``expected``: the served weights, where the caller has read them already.

    Raises:
        OdtdError: One line saying which array is wrong and how; nothing was changed.
    """
    incoming = _arrays(path, "the round's weights")
    if expected is None:
        expected = _arrays(served, "the served weights")
    if sorted(incoming) != sorted(expected):
        raise OdtdError(f"the round's weights hold {len(incoming)} arrays, the served model "
                        f"{len(expected)}: refused (is the server's model this device's?)")
    for key in sorted(expected):
        got, want = incoming[key], expected[key]
        if got.shape != want.shape:
            raise OdtdError(f"the round's weights: {key} has shape {got.shape}, the served model "
                            f"{want.shape}: refused")
        if got.dtype != want.dtype:
            raise OdtdError(f"the round's weights: {key} has dtype {got.dtype}, the served model "
                            f"{want.dtype}: refused")
        if got.dtype.kind in "fc" and not np.isfinite(got).all():
            raise OdtdError(f"the round's weights: {key} holds {int((~np.isfinite(got)).sum())} "
                            "values that are not finite: refused")
    return incoming


def is_statistic(name: str) -> bool:
    """Whether the weight ``name`` (``layer/variable``) is a BatchNorm layer's moving statistic."""
    return name.rsplit("/", 1)[-1] in _STATISTICS


def batchnorm_keys(weight_names: List[str]) -> List[str]:
    """The ``wNNNN`` keys of BatchNorm layers' parameters (the layers with moving statistics)."""
    layers = {name.rsplit("/", 1)[0] for name in weight_names if is_statistic(name)}
    return [f"w{index:04d}" for index, name in enumerate(weight_names)
            if name.rsplit("/", 1)[0] in layers]


class RoundStart(NamedTuple):
    """A round's start as ``write_start_weights`` wrote it."""

    path: Path
    # The served model's weights to the bit: a fleet's first round sends the devices' own base
    # back, which served as it came brings nothing, so the session is trained and judged as a
    # local one (``trains_from_round``).
    already_served: bool


def trains_from_round(details: Optional[Dict[str, Any]]) -> bool:
    """Whether a session trains from its round's model (``details``: its ``details.federated``).

    A federated session does, unless the round's model is the one the device already serves.
    """
    return bool(details) and not details.get("already_served")


def write_start_weights(federated: FederatedRound, served: Path, weight_names: Optional[List[str]],
                        job_dir: Path) -> RoundStart:
    """Check the round's weights and write the session's start (``job_dir/global.npz``).

    Beside ``check_global_weights``' checks, where the served version names its weights, no
    BatchNorm moving variance may be negative.

    With ``batchnorm: fedbn`` the BatchNorm layers' parameters are the served model's.

    Raises:
        OdtdError: The weights do not fit the served model, or ``fedbn`` without weight names.
    """
    kept = _arrays(served, "the served weights")  # read once: checked against, and FedBN's
    arrays = check_global_weights(Path(federated.weights_in), served, kept)
    if federated.batchnorm == "fedbn":
        if not weight_names:
            raise OdtdError("batchnorm fedbn: the served version's manifest names no weights")
        for key in batchnorm_keys(weight_names):
            arrays[key] = kept[key]
    for index, name in enumerate(weight_names or []):
        variance = arrays.get(f"w{index:04d}") if name.endswith("/moving_variance") else None
        negative = 0 if variance is None else int(np.sum(variance < 0))
        if negative:  # a server step past the devices' mean (Flower's FedAvgM moves statistics)
            raise OdtdError(f"the round's weights: {name} holds {negative} negative variances: "
                            "refused (a server step that moved BatchNorm's statistics?)")
    job_dir.mkdir(parents=True, exist_ok=True)
    start = job_dir / "global.npz"
    np.savez(start, **arrays)
    return RoundStart(start, all(np.array_equal(arrays[k], kept[k]) for k in kept))


def round_start(federated: FederatedRound, repo: ModelRepo, current: int, job_dir: Path
                ) -> RoundStart:
    """``write_start_weights`` against the served version ``current`` of ``repo``."""
    return write_start_weights(federated, repo.weights_path(current),
                               repo.manifest(current).get("weight_names"), job_dir)


def hand_back(job_dir: Path, federated: FederatedRound) -> bool:
    """Put the trained weights where the ClientApp reads them (a hard link where it can).

    The trained weights whole (``TRAINED_WEIGHTS``) where the worker averaged them with the
    round's start for the device's candidate (``trained_share``), else the candidate: the
    server averages the devices' updates, each device's guard judges its own candidate.

    Returns:
        False if the worker wrote no candidate (its training diverged).
    """
    candidate = job_dir / "candidate.npz"
    if not candidate.exists():
        return False
    trained = job_dir / TRAINED_WEIGHTS
    source = trained if trained.exists() else candidate
    out = Path(federated.weights_out)
    out.unlink(missing_ok=True)
    try:
        os.link(source, out)  # promotion moves the candidate into its version: the link stays
    except OSError:
        shutil.copyfile(source, out)
    return True
