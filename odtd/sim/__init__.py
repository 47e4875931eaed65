"""Simulated days and the data sets behind them: demos, tests, the reproduction scripts.

Modules: ``simulate`` (``odtctl simulate``: N days of ingest plus a session, through exactly the
code of real sessions), ``datasets`` (the built-in synthetic server/device images, real labelled
sets in ``<split>/<class>/<image>`` folders or tar archives, class-balanced daily draws),
``shifts`` (named camera shifts applied to the device's images: low light, a colour cast, blur,
fog, ...).

May import every package below ``cli``; numpy and Pillow, never TensorFlow.
"""
