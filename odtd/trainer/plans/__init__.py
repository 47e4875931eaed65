"""How a step fits in memory, and in which precision.

``recompute`` (gradient checkpointing by segments), ``dense_blocks`` and ``dense_chunks`` (a
DenseNet's dense blocks with memory linear in their depth), ``pool_first`` (a transition's
pooling before its 1x1 convolution), ``fused_batchnorm`` (Keras 3's BatchNorm on the fused
kernel), ``precision`` (precision ``auto``). The worker only.
"""
