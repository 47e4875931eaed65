"""The networks a worker trains, and the graph library every plan cuts them with.

``networks`` (the built-in models, how every graph is compiled), ``suite`` (the CNN suite's
builders), ``imported`` (a user's model rebuilt from its screened config, exported back; its
leaf and BatchNorm layers), ``graph`` (a functional model's graph: consumers, valid cuts, a
part as a model, a flat copy). They import TensorFlow: the worker process only.
"""
