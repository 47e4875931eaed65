"""The device's ClientApp: a Flower SuperNode beside the daemon runs it for each round.

    flower-supernode --superlink HOST:PORT --node-config 'socket="/var/lib/odtd/run/odtd.sock"'

Flower's Message API: a ``train`` message carries the global weights (``arrays``) and the round's
settings (``config``); the reply carries the trained weights and ``device.METRIC_KEYS``. A device
that declines (``device.Declined``: a closed gate, a spent budget, a session running, weights that
do not fit) raises, and Flower sends the server an error reply with the reason.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from odtd.fleet.device import evaluate_round, train_round

DEFAULT_SOCKET = "/var/lib/odtd/run/odtd.sock"  # the packaged unit's home (deploy/odtd.service)

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """One round: a federated session on this device; its trained weights and metrics back."""
    socket_path = Path(str(context.node_config.get("socket", DEFAULT_SOCKET)))
    config = dict(msg.content["config"]) if "config" in msg.content else {}
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    trained, metrics = train_round(socket_path, str(msg.metadata.run_id),
                                   int(config.get("server-round", 0)), arrays, config)
    content = RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """An evaluate round: the global weights scored on this device's own samples, nothing trained."""
    socket_path = Path(str(context.node_config.get("socket", DEFAULT_SOCKET)))
    config = dict(msg.content["config"]) if "config" in msg.content else {}
    metrics = evaluate_round(socket_path, str(msg.metadata.run_id),
                             int(config.get("server-round", 0)),
                             msg.content["arrays"].to_numpy_ndarrays(), config)
    return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
