"""Simulated days and the data sets behind them: demos, tests, the reproduction scripts.

Modules: ``simulate`` (``odtctl simulate``: N days of ingest plus a session, through exactly the
code of real sessions), ``datasets`` (the built-in synthetic server/device images, real labelled
sets in ``<split>/<class>/<image>`` folders or tar archives, class-balanced daily draws),
``shifts`` (named camera shifts applied to the device's images: low light, a colour cast, blur,
fog, ...), ``arms`` (scripts/reproduce_tx2_daily.py's arms: odtd and its controls on the same
days), ``scoring`` (the arms scored image by image on the same test images and compared).

May import every package below ``cli``; numpy and Pillow, never TensorFlow.
"""
