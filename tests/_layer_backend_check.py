"""Run StableBatchNormalization on one Keras backend; write the results to an .npz file.

Usage: KERAS_BACKEND=jax|tensorflow python tests/_layer_backend_check.py INPUTS.npz OUTPUTS.npz

The backend is chosen by KERAS_BACKEND before keras is imported, so each
backend needs its own process.  tests/test_layer.py runs this script once per
backend on the same inputs and compares the outputs bit for bit; the entries
prefixed "grad_", "fit_" and "saved_" are checked against tolerances.
"""

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402

from tf_stable_moments import StableBatchNormalization  # noqa: E402


def _numpy(v):
    return keras.ops.convert_to_numpy(v)


def _layer(inputs, shape, **kwargs):
    layer = StableBatchNormalization(momentum=0.9, **kwargs)
    layer.build(shape)
    layer.gamma.assign(inputs["gamma"])
    layer.beta.assign(inputs["beta"])
    return layer


def eager_results(inputs):
    """Training-mode outputs and moving statistics, eager calls only (compared bitwise)."""
    out = {}
    x, x2 = inputs["x"], inputs["x2"]
    for name, kwargs in (("plain", {}), ("compensated", {"compensated_moving_stats": True})):
        layer = _layer(inputs, x.shape, **kwargs)
        out[f"{name}_y1"] = _numpy(layer(x, training=True))
        out[f"{name}_y2"] = _numpy(layer(x2, training=True))
        out[f"{name}_inference"] = _numpy(layer(x, training=False))
        for weight in layer.non_trainable_weights:
            out[f"{name}_{weight.name}"] = _numpy(weight)
    layer = _layer(inputs, inputs["x_seq"].shape)
    out["masked_y"] = _numpy(layer(inputs["x_seq"], training=True, mask=inputs["mask"]))
    out["masked_moving_mean"] = _numpy(layer.moving_mean)
    out["masked_moving_variance"] = _numpy(layer.moving_variance)
    layer = StableBatchNormalization(axis=1)
    out["channels_first_y"] = _numpy(layer(inputs["x_nchw"], training=True))
    out["channels_first_moving_mean"] = _numpy(layer.moving_mean)
    return out


def _gradient(layer, x, g):
    """d sum(layer(x, training=True) * g) / dx on the active backend."""
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        x = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(layer(x, training=True) * g)
        return tape.gradient(loss, x).numpy()
    import jax

    trainable = [v.value for v in layer.trainable_variables]
    non_trainable = [v.value for v in layer.non_trainable_variables]

    def loss(x):
        y, _ = layer.stateless_call(trainable, non_trainable, x, training=True)
        return (y * g).sum()

    return np.asarray(jax.grad(loss)(x))


def other_results(inputs):
    """Gradients, a short fit and a .keras round trip (compared with tolerances)."""
    out = {}
    benign, g = inputs["benign"], inputs["g"]
    for name, cls in (
        ("ours", StableBatchNormalization),
        ("keras", keras.layers.BatchNormalization),
    ):
        layer = cls()
        layer.build(benign.shape)
        layer.gamma.assign(inputs["gamma"])
        out[f"grad_benign_{name}"] = _gradient(layer, benign, g)
    out["grad_offset_ours"] = _gradient(
        _layer(inputs, inputs["x"].shape), inputs["x"], inputs["g_offset"]
    )

    model = keras.Sequential(
        [keras.Input(inputs["x"].shape[1:]), StableBatchNormalization(momentum=0.5)]
    )
    model.compile(optimizer="sgd", loss="mse")
    model.fit(
        inputs["x"],
        np.zeros_like(inputs["x"]),
        batch_size=len(inputs["x"]),
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    out["fit_moving_mean"] = _numpy(model.layers[0].moving_mean)
    out["fit_moving_variance"] = _numpy(model.layers[0].moving_variance)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.keras"
        model.save(path)
        loaded = keras.models.load_model(path)
    out["saved_class"] = np.array(type(loaded.layers[0]).__qualname__)
    out["saved_predict"] = _numpy(model(inputs["x"], training=False))
    out["saved_loaded_predict"] = _numpy(loaded(inputs["x"], training=False))
    return out


def main(inputs_path, outputs_path):
    inputs = dict(np.load(inputs_path))
    np.savez(
        outputs_path,
        backend=np.array(keras.backend.backend()),
        **eager_results(inputs),
        **other_results(inputs),
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
