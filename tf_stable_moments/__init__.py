"""Correctly rounded mean and variance for TensorFlow: moments and a Keras layer.

`moments` is imported on first use (PEP 562 module __getattr__): it needs
TensorFlow, which `import tf_stable_moments` therefore does not import, so that
on the JAX Keras backend `StableBatchNormalization` and `stabilize` run without
TensorFlow.  The import registers the layer for `keras.models.load_model`.
"""

from tf_stable_moments._layer import StableBatchNormalization
from tf_stable_moments._swap import stabilize

__all__ = ["StableBatchNormalization", "moments", "stabilize"]


def __getattr__(name):
    if name == "moments":
        from tf_stable_moments._moments import moments

        globals()["moments"] = moments
        return moments
    raise AttributeError(f"module 'tf_stable_moments' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
