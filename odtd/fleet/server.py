"""The fleet's ServerApp: Flower's own strategies, each round recorded in the fleet's SQLite file.

``flwr run`` starts it on the SuperLink (``launch.app_dir`` writes the app's pyproject.toml);
its run config ``fleet-config`` names the server's YAML (``settings``). Each round's devices
asked, trained, declined (and why) or silent, the aggregated metrics, the joules and the round's
time go to ``rounds.RoundLog`` as the round is aggregated; the last global weights to
``output_weights``.
"""

from __future__ import annotations

import json
import logging
import re
import time
import zipfile
from pathlib import Path
from typing import Any, Iterable, List, Optional, Tuple, cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg, FedAvgM, FedProx

from odtd.fleet.packing import pack, packed_mask, unpack
from odtd.fleet.rounds import DeviceReply, RoundLog, RoundRecord, utc_now
from odtd.fleet.settings import FleetSettings, load_settings
from odtd.session.federated import is_statistic, read_weights, write_weights

logger = logging.getLogger(__name__)

app = ServerApp()

# How often the ServerApp asks the SuperLink for the round's replies. Flower's grid asks every
# 3 s, so a round's last reply waited 1.5 s on average (up to 3) after the device sent it.
REPLY_POLL_S = 0.25


class PromptGrid:
    """The SuperLink's grid, the round's replies asked for every ``REPLY_POLL_S``.

    ``send_and_receive`` is Flower's (push the messages, pull their replies until all are in or
    ``timeout`` passes) with a shorter wait between pulls; every other attribute is the grid's
    Flower gave the ServerApp, as it is (its ``get_nodes``, ``close``, ... included).
    """

    def __init__(self, grid: Grid, poll_s: float = REPLY_POLL_S) -> None:
        self.grid, self.poll_s = grid, poll_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: Optional[float] = None) -> Iterable[Message]:
        """Push the messages; pull their replies every ``poll_s`` until all are in or ``timeout`` passes."""
        waiting = set(self.grid.push_messages(messages))
        end = time.monotonic() + (timeout or 0.0)
        replies: List[Message] = []
        while waiting and (timeout is None or time.monotonic() < end):
            got = list(self.grid.pull_messages(waiting))
            replies += got
            waiting.difference_update(m.metadata.reply_to_message_id for m in got)
            if waiting:
                left = self.poll_s if timeout is None else end - time.monotonic()
                time.sleep(max(0.0, min(self.poll_s, left)))
        return replies


def _reason(error_reason: str) -> str:
    """Flower's ``<class 'X'>:<'why'>`` as the device's own words."""
    found = re.fullmatch(r"<class '[^']*'>:<['\"](.*)['\"]>", error_reason or "", re.S)
    return found.group(1) if found else error_reason


class _Recording:
    """A strategy mixin: times each training round and records every device's part of it."""

    log: RoundLog
    run_id: str
    round_timeout_s: float

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))  # type: ignore[misc]
        self._asked = messages  # the grid gives each its message id as it sends it
        self._started = (time.monotonic(), utc_now())
        print(f"round {server_round}: asking {len(messages)} devices", flush=True)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        replies = list(replies)
        arrays, metrics = super().aggregate_train(server_round, replies)  # type: ignore[misc]
        devices = [_device_reply(reply, self._asked, "trained") for reply in replies]
        answered = {d.node_id for d in devices}
        devices += [DeviceReply(str(node), "no reply",
                                f"no reply within {self.round_timeout_s:g} s")
                    for node in (m.metadata.dst_node_id for m in self._asked)
                    if str(node) not in answered]
        record = RoundRecord(run_id=self.run_id, round=server_round, started_at=self._started[1],
                             seconds=time.monotonic() - self._started[0], devices=devices,
                             metrics=dict(metrics) if metrics is not None else {})
        self.log.add_round(record)
        declined = _declined(devices)
        print(f"round {server_round}: {record.count('trained')} trained, {record.count('declined')} "
              f"declined, {record.count('no reply')} silent in {record.seconds:.1f} s"
              + (f" ({declined})" if declined else ""), flush=True)
        return arrays, metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        self._asked_to_evaluate = list(super().configure_evaluate(  # type: ignore[misc]
            server_round, arrays, config, grid))
        return self._asked_to_evaluate

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> Optional[MetricRecord]:
        replies = list(replies)
        metrics = super().aggregate_evaluate(server_round, replies)  # type: ignore[misc]
        if not replies:  # no evaluate round asked for (evaluate_fraction 0): nothing to record
            return metrics
        devices = [_device_reply(r, getattr(self, "_asked_to_evaluate", []), "evaluated")
                   for r in replies]
        self.log.add_evaluation(self.run_id, server_round,
                                dict(metrics) if metrics is not None else {}, devices)
        accuracy = (dict(metrics) if metrics is not None else {}).get("accuracy")
        print(f"round {server_round}: evaluated on {sum(d.outcome == 'evaluated' for d in devices)} "
              "devices' own samples" + (f", accuracy {accuracy:.3f}" if accuracy is not None else "")
              + (f" ({_declined(devices)})" if _declined(devices) else ""), flush=True)
        return metrics


def _device_reply(reply: Message, asked: List[Message], done: str) -> DeviceReply:
    """A reply as the round records it.

    ``done`` with its metrics, ``declined`` with the device's reason, or ``no reply`` with the
    SuperLink's for a device gone: a device that went silent (its SuperNode killed) gets the
    SuperLink's error reply, sent from the SuperLink's own node id; the message it answers
    (``asked``) names the device.
    """
    node = next((m.metadata.dst_node_id for m in asked if m.metadata.message_id
                 and m.metadata.message_id == reply.metadata.reply_to_message_id),
                reply.metadata.src_node_id)
    if not reply.has_error():
        return DeviceReply(str(node), done, metrics=dict(reply.content["metrics"]))
    gone = node != reply.metadata.src_node_id
    return DeviceReply(str(node), "no reply" if gone else "declined", _reason(reply.error.reason))


def _declined(devices: List[DeviceReply]) -> str:
    """The devices that did not take part, with why, for a progress line."""
    return "; ".join(f"{d.node_id}: {d.reason}" for d in devices if d.outcome in ("declined", "no reply"))


class RecordingFedAvg(_Recording, FedAvg):
    """FedAvg, each round recorded."""


class _KeptMean(FedAvg):
    """FedAvg whose aggregate keeps the replies' weighted mean's arrays (``kept_mean``).

    Placed after FedAvgM in a class's bases, it is the ``super()`` FedAvgM's aggregate calls, so
    the mean is computed (and logged by Flower) once. FedAvgM then empties that record, so the
    arrays are kept as a list (references, read only where they are needed).
    """

    kept_mean: Optional[List[Array]] = None

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        mean, metrics = super().aggregate_train(server_round, replies)
        self.kept_mean = None if mean is None else list(mean.values())
        return mean, metrics


class AveragedStatisticsFedAvgM(FedAvgM, _KeptMean):
    """FedAvgM whose server step moves the trained weights; BatchNorm's statistics are averaged.

    Flower's FedAvgM steps every array from the last global model by its server rate times the
    (momentum of the) mean update, BatchNorm's moving means and variances too. Those are not
    trained: they describe what the trained weights make of the images, and a step past their
    mean (a rate above 1, or momentum) can take a variance below 0 (measured: after one round of
    eight DenseNet40 devices, three epochs each, a third of the layers had a channel whose mean
    variance was below half the start's, which a rate of 2 makes negative). Here the statistics
    are FedAvg's weighted mean of the replies, as they are with ``fedavg``, and the next round's
    step starts from that.

    ``statistics``: per packed array, True where an element is a moving statistic; None (the
    weights' names unknown): every array is stepped, as Flower's FedAvgM does.
    """

    statistics: Optional[List[np.ndarray]] = None

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> Tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """FedAvgM's aggregate, its BatchNorm statistics replaced by the replies' weighted mean."""
        stepped, metrics = super().aggregate_train(server_round, replies)
        if stepped is None or self.statistics is None or not self.server_opt:
            return stepped, metrics
        assert self.kept_mean is not None  # the same aggregate gave the stepped arrays
        arrays = [np.where(mask, mean, step) for mask, mean, step in
                  zip(self.statistics, (a.numpy() for a in self.kept_mean),
                      stepped.to_numpy_ndarrays())]
        record = ArrayRecord({key: Array(np.asarray(array))
                              for key, array in zip(stepped.keys(), arrays)})
        self.current_arrays = record
        return record, metrics


class RecordingFedAvgM(_Recording, AveragedStatisticsFedAvgM):
    """FedAvgM (server momentum; its step on the trained weights only), each round recorded."""


class RecordingFedProx(_Recording, FedProx):
    """FedProx (each device's loss holds the proximal term), each round recorded."""


def make_strategy(settings: FleetSettings, log: RoundLog, run_id: str,
                  statistics: Optional[List[np.ndarray]] = None) -> FedAvg:
    """The settings' strategy.

    Each round trains; with ``evaluate_fraction`` an evaluate round after it scores the global
    model on the devices' own samples. ``statistics``: FedAvgM's mask of BatchNorm statistics
    in the packed weights (``AveragedStatisticsFedAvgM``).
    """
    common: dict[str, Any] = dict(fraction_train=settings.fraction,
                                  fraction_evaluate=settings.evaluate_fraction,
                                  min_train_nodes=settings.min_devices,
                                  min_evaluate_nodes=settings.min_devices * (settings.evaluate_fraction > 0),
                                  min_available_nodes=settings.min_devices)
    if settings.strategy == "fedavgm":
        strategy: FedAvg = RecordingFedAvgM(server_learning_rate=settings.server_learning_rate,
                                            server_momentum=settings.server_momentum, **common)
        strategy.statistics = statistics  # type: ignore[attr-defined]
    elif settings.strategy == "fedprox":
        strategy = RecordingFedProx(proximal_mu=settings.proximal_mu, **common)
    else:
        strategy = RecordingFedAvg(**common)
    strategy.log, strategy.run_id = log, run_id  # type: ignore[attr-defined]
    strategy.round_timeout_s = settings.round_timeout_s  # type: ignore[attr-defined]
    return strategy


def weight_names(weights: Path, count: int) -> Optional[List[str]]:
    """The names of the ``count`` arrays in ``weights``, where a file beside it gives them.

    A version's ``weights.npz`` has its ``manifest.json`` beside it; the global weights a run
    writes have ``NAME.names.json`` (``write_weight_names``), so the next run's start has names.
    None where neither is there, or it names another count of arrays.
    """
    for path, key in ((weights.with_name(weights.stem + ".names.json"), "weight_names"),
                      (weights.with_name("manifest.json"), "weight_names")):
        try:
            names = json.loads(path.read_text(encoding="utf-8")).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(names, list) and len(names) == count:
            return [str(name) for name in names]
    return None


def statistics_mask(names: Optional[List[str]], layout: List[str]) -> Optional[List[np.ndarray]]:
    """Per packed array (``pack``'s), True at BatchNorm's moving statistics; None without names."""
    return None if names is None else packed_mask(layout, [is_statistic(name) for name in names])


def write_weight_names(weights: Path, names: List[str]) -> None:
    """Write ``NAME.names.json`` beside the weights file ``weights`` (``weight_names`` reads it)."""
    weights.with_name(weights.stem + ".names.json").write_text(
        json.dumps({"weight_names": names}), encoding="utf-8")


def momentum_file(weights: Path) -> Path:
    """Where FedAvgM's momentum goes beside the global weights a run wrote (``NAME.momentum.npz``)."""
    return weights.with_name(weights.stem + ".momentum.npz")


def resume_momentum(strategy: FedAvg, weights: Path, packed: List[np.ndarray]) -> bool:
    """Give a FedAvgM ``strategy`` the momentum the run that wrote its start ``weights`` left.

    Only where that fits the packed arrays ``packed`` (the same count and shapes, finite). A run
    that starts where another ended (the next day of ``fleet simulate``, a server started again
    on its last output) then steps as one run of both runs' rounds. False where there is no such
    momentum, or the strategy keeps none.
    """
    if not isinstance(strategy, FedAvgM) or strategy.server_momentum <= 0:
        return False
    try:
        momentum = read_weights(momentum_file(weights))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return False
    if [m.shape for m in momentum] != [a.shape for a in packed] or not all(
            np.isfinite(m).all() for m in momentum):
        return False
    strategy.momentum_vector = momentum
    return True


def save_momentum(strategy: FedAvg, weights: Path) -> None:
    """Write a FedAvgM ``strategy``'s momentum beside the global ``weights`` its run wrote.

    Where it keeps none, what an earlier run left there is removed: no later run takes it up.
    """
    if isinstance(strategy, FedAvgM) and strategy.server_momentum > 0 and \
            strategy.momentum_vector is not None:
        write_weights(momentum_file(weights), list(strategy.momentum_vector))
    else:
        momentum_file(weights).unlink(missing_ok=True)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the YAML's rounds and record each."""
    settings = load_settings(Path(str(context.run_config["fleet-config"])))
    run_id = str(context.run_id)
    log = RoundLog(settings.record)
    try:
        log.start_run(run_id, settings.model_dump(mode="json"))
        initial = read_weights(settings.initial_weights)
        # One flat array per dtype a message (odtd.fleet.packing): Flower moves each array as
        # an object of its own, one request per hop.
        packed, layout = pack(initial)
        names = weight_names(settings.initial_weights, len(initial))
        strategy = make_strategy(settings, log, run_id, statistics_mask(names, layout))
        if names is None and isinstance(strategy, FedAvgM) and strategy.server_opt:
            print(f"{settings.initial_weights}: no manifest.json or .names.json beside it names the "
                  "weights, so FedAvgM's server step moves BatchNorm's statistics too", flush=True)
        if resume_momentum(strategy, settings.initial_weights, packed):
            print(f"FedAvgM's momentum carried from {momentum_file(settings.initial_weights)}",
                  flush=True)
        train_config = ConfigRecord({"batchnorm": settings.batchnorm, "layout": layout,
                                     "local-epochs": settings.local_epochs or 0,
                                     "learning-rate": settings.learning_rate or 0.0})
        result = strategy.start(grid=cast(Grid, PromptGrid(grid)), initial_arrays=ArrayRecord(packed),
                                num_rounds=settings.rounds, timeout=settings.round_timeout_s,
                                train_config=train_config,
                                evaluate_config=ConfigRecord({"batchnorm": settings.batchnorm,
                                                              "layout": layout}))
        # Flower's result holds no arrays when no round aggregated any (every device declined):
        # then the start stands.
        got = result.arrays.to_numpy_ndarrays() if result.arrays is not None else []
        final = unpack(got, layout) if got else initial
        write_weights(settings.output_weights, final)
        if names is not None:
            write_weight_names(settings.output_weights, names)
        save_momentum(strategy, settings.output_weights)
        log.finish_run(run_id)
        print(f"run {run_id}: {settings.rounds} rounds; global weights in {settings.output_weights}",
              flush=True)
    finally:
        log.close()
