"""odtd's side of a Flower fleet (``pip install 'odtd[fleet]'``; docs/fleet.md).

Only ``client`` and ``server`` import Flower (``flwr``, Python >= 3.11); on a board whose
daemon runs an older Python they run in a venv of their own and reach the daemon only over
its control socket. The daemon never imports this package.

- ``settings``: the server's YAML (rounds, devices, local epochs, learning rate, strategy).
- ``device``: one round on a device: the global weights to a federated session and back.
- ``client``: the ClientApp a SuperNode runs beside the daemon.
- ``server``: the ServerApp, Flower's strategies, each round recorded by ``rounds``.
- ``rounds``: the server's SQLite record of rounds (``odtctl fleet status``).
- ``launch``: Flower's processes (SuperLink, SuperNodes, ``flwr run``) on one machine.
"""
