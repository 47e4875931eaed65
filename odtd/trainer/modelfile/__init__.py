"""A user's Keras model file, read and screened without TensorFlow.

``model_file`` (reads a ``.keras``/``.h5`` config and screens it: the layer allowlist, Lambda
and custom objects refused), ``model_config`` (what a screened config says: dialect, input
shape, classes, output convention), ``keras_dialects`` (Keras 2 and 3 configs translated both
ways), ``arithmetic`` (a file's plain tensor arithmetic rewritten as layers). Standard library
only (``h5py`` for ``.h5`` files, lazily); Python 3.6-compatible.
"""
