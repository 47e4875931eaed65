"""``python -m odtd.trainer.worker JOB.json``: the trainer worker (docs/worker-protocol.md).

With ``ODTD_WORKER_SERVER`` set, a fork of a process that imported TensorFlow once runs the job,
and this process only stands in for it: it hands the job over before importing numpy and the
trainer's modules (0.2 s of CPU it would not use). Without the variable, or if that server
cannot take the job, this process runs it (``process.main``).
"""

import sys

from odtd.trainer.worker import forkserver

if __name__ == "__main__":
    _HANDED_OVER = forkserver.handed_over(sys.argv[1:])
    if _HANDED_OVER is not None:
        sys.exit(_HANDED_OVER)
    from odtd.trainer.worker import process

    sys.exit(process.main())
