"""The JAX-backend part of tests/test_models.py, in its own process.

Usage: KERAS_BACKEND=jax python tests/_models_check.py SAVED.keras OUT_DIR

SAVED.keras holds a model with StableBatchNormalization (written by the test on the
TensorFlow backend).  Prints one line "RESULT {json}":
  load_error: the message of keras.saving.load_model(SAVED) before the package is imported;
  tensorflow_after_import / tensorflow_after_layer: whether TensorFlow was imported by
    `import tf_stable_moments` / by training and inference calls of the layer;
  loaded_type: the class of the saved layer once the package is imported;
  fit: a stem of keras.applications.MobileNet, every BN swapped, one epoch of fit with a
    partial last batch (jit), then predictions before and after save/load, and whether
    the original model still runs (stabilize copies the weights);
  stall: warnings of a stalled moving mean under fit (jit), and whether the traced
    training step holds the native stall check and no lax.cond.
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras  # noqa: E402


def main(saved, out_dir):
    result = {}
    try:
        keras.saving.load_model(saved)
        result["load_error"] = None
    except Exception as error:  # noqa: BLE001  (the message is the result)
        result["load_error"] = f"{type(error).__name__}: {error}"

    import tf_stable_moments

    result["tensorflow_after_import"] = "tensorflow" in sys.modules
    layer = tf_stable_moments.StableBatchNormalization()
    x = np.random.default_rng(0).normal(1e6, 1.0, (32, 4)).astype(np.float32)
    layer(x, training=True)
    layer(x, training=False)
    result["tensorflow_after_layer"] = "tensorflow" in sys.modules

    loaded = keras.saving.load_model(saved)
    result["loaded_type"] = type(loaded.layers[-1]).__qualname__

    keras.utils.set_random_seed(0)
    base = keras.applications.MobileNet(
        weights=None, input_shape=(32, 32, 3), alpha=0.25, classes=4
    )
    stem = keras.Model(base.input, base.get_layer("conv_pw_1_relu").output)
    inputs = keras.Input((32, 32, 3))
    h = keras.layers.GlobalAveragePooling2D()(stem(inputs))
    original = keras.Model(inputs, keras.layers.Dense(4)(h))
    model = tf_stable_moments.stabilize(original)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(12, 32, 32, 3)).astype(np.float32)
    ys = np.arange(12) % 4
    history = model.fit(xs, ys, batch_size=8, epochs=1, verbose=0)  # batches of 8 and 4
    swapped = [
        type(layer).__qualname__
        for layer in model._flatten_layers()
        if isinstance(layer, keras.layers.BatchNormalization)
    ]
    path = str(Path(out_dir) / "jax_model.keras")
    model.save(path)
    before = np.asarray(model.predict(xs[:8], batch_size=8, verbose=0))
    after = np.asarray(keras.saving.load_model(path).predict(xs[:8], batch_size=8, verbose=0))
    # fit donates the swapped model's buffers: the original's must be its own (a copy).
    original_prediction = np.asarray(original.predict(xs[:8], verbose=0))
    result["fit"] = {
        "original_still_runs": bool(np.all(np.isfinite(original_prediction))),
        "loss": [float(v) for v in history.history["loss"]],
        "bn_classes": swapped,
        "same_bits": bool(np.array_equal(before.view(np.uint32), after.view(np.uint32))),
        "finite": bool(np.all(np.isfinite(before))),
    }
    result["stall"] = stall_check()
    result["step_calls"] = step_calls()
    print("RESULT " + json.dumps(result))


def step_calls():
    """{platform: the custom-call targets of a BN layer's gradient step lowered for it}."""
    import re

    import jax

    import tf_stable_moments

    layer = tf_stable_moments.StableBatchNormalization()
    layer.build((None, 4))
    trainable = [v.value for v in layer.trainable_variables]
    other = [v.value for v in layer.non_trainable_variables]
    x = np.random.default_rng(3).normal(size=(64, 4)).astype(np.float32)

    def loss(t, v):
        y, _ = layer.stateless_call(t, other, v, training=True)
        return (y * y).sum()

    step = jax.jit(jax.grad(loss))
    out = {}
    for platform in ("cpu", "cuda", "tpu"):
        text = step.trace(trainable, x).lower(lowering_platforms=(platform,)).as_text()
        out[platform] = sorted(set(re.findall(r"stablehlo.custom_call @(\w+)", text)))
    return out


def stall_check():
    """A stalled moving mean under jit (fit): one warning, from the native FFI check (one
    custom call per layer: no lax.cond in the traced training step)."""
    import warnings

    import jax

    import tf_stable_moments

    rng = np.random.default_rng(31)
    x = rng.normal(1e6, 1.0, (100 * 64, 4)).astype(np.float32)
    out = {}
    for compensated in (False, True):
        layer = tf_stable_moments.StableBatchNormalization(
            momentum=0.9,
            compensated_moving_stats=compensated,
            moving_mean_initializer=keras.initializers.Constant(1e6 - 2),
        )
        model = keras.Sequential([keras.Input((4,)), layer])
        model.compile("sgd", "mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, np.zeros_like(x), batch_size=64, verbose=0)
        messages = [str(w.message) for w in caught]
        out[f"warnings_compensated_{compensated}"] = sum(
            "cannot follow the batch mean" in m for m in messages
        )
    layer = tf_stable_moments.StableBatchNormalization()
    layer.build((None, 4))
    trainable = [v.value for v in layer.trainable_variables]
    other = [v.value for v in layer.non_trainable_variables]
    jaxpr = str(
        jax.make_jaxpr(lambda v: layer.stateless_call(trainable, other, v, training=True))(x[:64])
    )
    out["ffi_check"] = "tf_stable_moments_native_stall_check" in jaxpr
    out["cond"] = "cond[" in jaxpr
    return out


if __name__ == "__main__":
    main(*sys.argv[1:3])
