"""One job's learning.

``training`` (the order of work: score, train, recalibrate, average,
score), ``step`` (the compiled train step), ``batchnorm`` (moving statistics streamed over
images), ``distill`` (the served model's soft targets), ``averaging`` (the candidate as a share
of the trained weights), ``evaluation`` (scoring) and ``evalcache`` (per-sample scores kept
between sessions). The worker only.
"""
