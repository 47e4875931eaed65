"""``odtd run``: the long-running service and the parts only it uses.

Modules: ``service`` (``Daemon``, the composition root, and ``main``), ``scheduler`` (the cron
schedule on APScheduler 3.x, the only module that imports apscheduler), ``control`` (the Unix
control socket: server here, client for ``odtctl``), ``inbox`` (the spool-directory watcher),
``health`` (the home's disk as the daemon sees it: read-only, gone or below its floor, reported
and retried), ``sdnotify`` (systemd's notification protocol).

May import every other package; never TensorFlow. ``odtctl`` imports ``control`` (the client)
and ``scheduler`` (cron validation), nothing else from here.
"""
