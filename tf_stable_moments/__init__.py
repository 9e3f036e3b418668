"""Correctly rounded mean and variance for TensorFlow: moments, drop-in functions, a
mergeable state, Keras normalization layers.

The functions that need TensorFlow (`moments`, the tf.nn / tf.math drop-ins, the
state) are imported on first use (PEP 562 module __getattr__), so that
`import tf_stable_moments` does not import TensorFlow: on the JAX Keras backend the
layers and `stabilize` run without it.  The import registers the layers for
`keras.models.load_model`.
"""

import importlib as _importlib

from tf_stable_moments._group_norm import StableGroupNormalization
from tf_stable_moments._keras_moments import keras_moments
from tf_stable_moments._layer import StableBatchNormalization
from tf_stable_moments._layer_norm import StableLayerNormalization
from tf_stable_moments._normalization import StableNormalization
from tf_stable_moments._swap import stabilize

# name -> the private module that defines it (imported on first use: needs TensorFlow)
_LAZY = {
    "moments": "_union",
    "reduce_std": "_functions",
    "reduce_variance": "_functions",
    "weighted_moments": "_functions",
    "MomentsState": "_state",
    "accumulate_state": "_state",
    "merge_states": "_state",
    "moments_state": "_state",
    "portable": "_native",
    "state_moments": "_state",
}

__all__ = [
    "MomentsState",
    "StableBatchNormalization",
    "StableGroupNormalization",
    "StableLayerNormalization",
    "StableNormalization",
    "accumulate_state",
    "keras_moments",
    "merge_states",
    "moments",
    "moments_state",
    "portable",
    "reduce_std",
    "reduce_variance",
    "stabilize",
    "state_moments",
    "weighted_moments",
]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(_importlib.import_module(f"tf_stable_moments.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tf_stable_moments' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
