"""StableLayerNormalization and StableGroupNormalization on one Keras backend.

Usage: KERAS_BACKEND=jax python tests/_norm_backend_check.py INPUTS.npz OUTPUTS.npz

tests/test_norm_layers.py calls `results` in its own process (TensorFlow
backend) and runs this script under the JAX backend (the backend is chosen by
KERAS_BACKEND before keras is imported, so it needs its own process), on the
same inputs.  Entries without a prefix are eager outputs, compared bit for bit
between the backends; "jit_" entries (JAX only: jax.jit of our layer and, as
"jit_keras_", of keras's, measured beside it) are checked for accuracy;
"grad_" (JAX: under jax.jit), "fit_" and "saved_" entries against tolerances.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402

from tf_stable_moments import (  # noqa: E402
    StableGroupNormalization,
    StableLayerNormalization,
    StableNormalization,
)

GROUPS = 8  # of the 32 channels of inputs["x_gn"]


def _numpy(v):
    return keras.ops.convert_to_numpy(v)


def _layer(cls, inputs, shape, prefix, **kwargs):
    """A built layer with gamma and beta from inputs[prefix + "_gamma" / "_beta"]."""
    layer = cls(**kwargs)
    layer.build(shape)
    if layer.gamma is not None:
        layer.gamma.assign(inputs[f"{prefix}_gamma"])
    if layer.beta is not None:
        layer.beta.assign(inputs[f"{prefix}_beta"])
    return layer


def accuracy_layers(inputs):
    """{name: (keras layer, our layer, input)}: the layers of the accuracy test."""
    ln = {
        "x": inputs["x_ln"],
        "classes": (keras.layers.LayerNormalization, StableLayerNormalization),
    }
    gn = {
        "x": inputs["x_gn"],
        "classes": (keras.layers.GroupNormalization, StableGroupNormalization),
        "kwargs": {"groups": GROUPS},
    }
    out = {}
    for name, spec in (("ln", ln), ("gn", gn)):
        theirs, ours = (
            _layer(cls, inputs, spec["x"].shape, name, **spec.get("kwargs", {}))
            for cls in spec["classes"]
        )
        out[name] = (theirs, ours, spec["x"])
    return out


def _jit_call(layer):
    """The layer as one jax.jit-compiled function of its input (JAX backend)."""
    import jax

    trainable = [v.value for v in layer.trainable_variables]

    @jax.jit
    def fn(x):
        return layer.stateless_call(trainable, [], x)[0]

    return fn


def eager_results(inputs):
    """Eager outputs (compared bit for bit between the backends); on JAX also jax.jit ones."""
    out = {}
    for name, (theirs, ours, x) in accuracy_layers(inputs).items():
        out[name] = _numpy(ours(x))
        if keras.backend.backend() == "jax":
            out[f"jit_{name}"] = _numpy(_jit_call(ours)(x))
            out[f"jit_keras_{name}"] = _numpy(_jit_call(theirs)(x))
    variants = {
        "ln_axes_12": (StableLayerNormalization, inputs["x_ln3"], {"axis": (1, 2)}),
        "ln_rms_scaling": (StableLayerNormalization, inputs["x_ln3"], {"rms_scaling": True}),
        "gn_channels_first": (
            StableGroupNormalization,
            inputs["x_gn_nchw"],
            {"groups": 4, "axis": 1},
        ),
    }
    for name, (cls, x, kwargs) in variants.items():
        out[name] = _numpy(cls(**kwargs)(x))
    out.update(normalization_results())
    out.update(functional_moments(inputs["x_ln3"]))
    return out


def functional_moments(x):
    """keras_moments on a KerasTensor: a functional model built with it (as with
    keras.ops.moments), called on x."""
    from tf_stable_moments import keras_moments

    inputs = keras.Input(x.shape[1:])
    mean, var = keras_moments(inputs, [1], keepdims=True)
    assert tuple(mean.shape) == (None, 1, x.shape[2]) and mean.dtype == "float32"
    model = keras.Model(inputs, [mean, var])
    mean, var = model(x)
    return {"functional_mean": _numpy(mean), "functional_var": _numpy(var)}


def normalization_data():
    """Features at offsets 1e6 and 1e7 (float32 [3001, 4]), for StableNormalization."""
    rng = np.random.default_rng(12)
    offsets = np.array([1e6, -1e6, 1e7, 3.0])
    return (offsets + rng.standard_normal((3001, 4))).astype(np.float32)


def normalization_results():
    """StableNormalization adapted in batches of 1000 (numpy), then called; invert too."""
    x = normalization_data()
    norm = StableNormalization(axis=-1)
    norm.adapt([x[i : i + 1000] for i in range(0, len(x), 1000)])  # batches of 1000 and 1
    invert = StableNormalization(axis=-1, invert=True)
    invert.adapt(x)
    y = _numpy(norm(x))
    return {
        "norm": y,
        "norm_weights": np.concatenate(
            [_numpy(w).astype(np.float32).ravel() for w in norm.weights]
        ),
        "norm_invert": _numpy(invert(y)),
    }


def _gradients(layer, x, g):
    """d sum(layer(x) * g) / d (x, *trainable weights) on the active backend."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x) * g)
        return [t.numpy() for t in tape.gradient(loss, [x, *layer.trainable_weights])]
    import jax

    def loss(x, trainable):
        return (layer.stateless_call(trainable, [], x)[0] * g).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))  # one compilation, not one per operation
    dx, dw = grad(x, [v.value for v in layer.trainable_variables])
    return [np.asarray(t) for t in (dx, *dw)]


def gradient_results(inputs):
    """Input and weight gradients of keras's layers and ours on N(0, 1) data; ours at 1e6."""
    out = {}
    for name, cls_pair, kwargs in (
        ("ln", (keras.layers.LayerNormalization, StableLayerNormalization), {}),
        ("gn", (keras.layers.GroupNormalization, StableGroupNormalization), {"groups": 4}),
    ):
        x, g = inputs[f"benign_{name}"], inputs[f"g_{name}"]
        for who, cls in zip(("keras", "ours"), cls_pair):
            layer = _layer(cls, inputs, x.shape, f"benign_{name}", **kwargs)
            for part, value in zip(("x", "gamma", "beta"), _gradients(layer, x, g)):
                out[f"grad_{name}_{who}_{part}"] = value
    layer = _layer(StableLayerNormalization, inputs, inputs["x_ln"].shape, "ln")
    out["grad_offset_ln_x"] = _gradients(layer, inputs["x_ln"], inputs["g_offset_ln"])[0]
    return out


def fit_results(inputs):
    """Two full-batch SGD steps of Dense -> LN -> GN, then a .keras round trip."""
    x = inputs["fit_x"]
    model = keras.Sequential(
        [
            keras.Input(x.shape[1:]),
            keras.layers.Dense(8, kernel_initializer="ones"),
            StableLayerNormalization(),
            StableGroupNormalization(groups=4),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, inputs["fit_y"], batch_size=len(x), epochs=2, shuffle=False, verbose=0)
    out = {f"fit_{i}_{w.name}": _numpy(w) for i, w in enumerate(model.weights)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.keras"
        model.save(path)
        loaded = keras.models.load_model(path)  # no custom_objects
    out["saved_classes"] = np.array([type(layer).__qualname__ for layer in loaded.layers[1:]])
    out["saved_predict"] = _numpy(model(x))
    out["saved_loaded_predict"] = _numpy(loaded(x))
    return out


def results(inputs):
    return {
        "backend": np.array(keras.backend.backend()),
        **eager_results(inputs),
        **gradient_results(inputs),
        **fit_results(inputs),
    }


if __name__ == "__main__":
    np.savez(sys.argv[2], **results(dict(np.load(sys.argv[1]))))
