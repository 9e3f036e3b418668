"""StableBatchNormalization: accuracy on offset data, backend agreement, Keras compatibility.

Runs on the TensorFlow Keras backend in this process; the JAX backend runs in a
subprocess (tests/_layer_backend_check.py), next to a TensorFlow one, and the
two are compared bit for bit.
"""

import inspect
import os
import pickle
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src import testing as keras_testing

import tf_stable_moments
from tf_stable_moments import StableBatchNormalization
from tf_stable_moments._oracle import exact_value, ulp_error

REPO = Path(__file__).resolve().parents[1]
MODES = ("eager", "tf_function", "jit_compile")
F32_TOL = 1e-5

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="in-process tests use the TensorFlow backend"
)


# ------------------------------------------------------------------ helpers
def _offset_data(offset, shape=(512, 16), seed=0):
    return (offset + np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def _reference(x, gamma=1.0, beta=0.0, epsilon=1e-3, axis=-1, weights=None):
    """Batch normalization of the float32 inputs in float64; weights: 0/1 like x, or None."""
    x = x.astype(np.float64)
    axes = tuple(a for a in range(x.ndim) if a != axis % x.ndim)
    w = np.ones_like(x) if weights is None else weights.astype(np.float64)
    mean = (w * x).sum(axes, keepdims=True) / w.sum(axes, keepdims=True)
    var = (w * (x - mean) ** 2).sum(axes, keepdims=True) / w.sum(axes, keepdims=True)
    return gamma * (x - mean) / np.sqrt(var + epsilon) + beta


def _training_call(layer, mode):
    if mode == "eager":
        return lambda x, **kw: layer(x, training=True, **kw)
    fn = tf.function(lambda x: layer(x, training=True), jit_compile=mode == "jit_compile")
    return lambda x: fn(tf.constant(x))


def _max_error(y, ref):
    return float(np.max(np.abs(keras.ops.convert_to_numpy(y).astype(np.float64) - ref)))


# ------------------------------------------------------------------ accuracy on offset data
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("offset", [1e6, 1e7], ids=["offset_1e6", "offset_1e7"])
def test_training_output_matches_float64(offset, mode):
    x = _offset_data(offset)
    y = _training_call(StableBatchNormalization(), mode)(x)
    assert _max_error(y, _reference(x)) < F32_TOL


@pytest.mark.parametrize("mode", MODES)
def test_keras_batch_normalization_fails_at_offset_1e6(mode):
    """The problem this layer solves: keras's own layer is off by more than 1e-2."""
    x = _offset_data(1e6)
    y = _training_call(keras.layers.BatchNormalization(), mode)(x)
    assert _max_error(y, _reference(x)) > 1e-2


@pytest.mark.parametrize("mode", MODES)
def test_constant_input_gives_exactly_beta(mode):
    layer = StableBatchNormalization()
    layer.build((512, 16))
    beta = np.linspace(-2, 2, 16, dtype=np.float32)
    layer.gamma.assign(np.full(16, 3.0, np.float32))
    layer.beta.assign(beta)
    y = _training_call(layer, mode)(np.full((512, 16), 1e10, np.float32))
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(y), np.broadcast_to(beta, (512, 16)))


def _centre_channels(dtype):
    """[16, 3, 7] columns: offsets, N(0, 1), a constant, tiny values whose differences are
    subnormal (flushed), huge ones, a NaN channel and an Inf one."""
    rng = np.random.default_rng(5)
    tiny = np.finfo(dtype).tiny
    x = np.stack(
        [
            rng.normal(1e6, 1.0, (16, 3)),
            rng.normal(0.0, 1.0, (16, 3)),
            np.full((16, 3), 7.25),
            tiny * (1.0 + rng.integers(0, 4, (16, 3)) / 8),
            rng.normal(0.0, 1e30, (16, 3)),
            np.where(rng.uniform(size=(16, 3)) < 0.1, np.nan, 1.0),
            np.where(rng.uniform(size=(16, 3)) < 0.1, np.inf, 2.0),
        ],
        axis=-1,
    ).astype(dtype)
    x[0, 0, 5], x[1, 1, 6] = np.nan, np.inf
    return x


def _assert_same(a, b, what):
    a, b = np.asarray(a), np.asarray(b)
    assert np.array_equal(np.isnan(a), np.isnan(b)), what
    keep = ~np.isnan(a)
    width = {4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    assert np.array_equal(a[keep].view(width), b[keep].view(width)), what


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_native_centre_op_has_the_bits_of_the_composite_path(dtype, graph, monkeypatch):
    """StableCentre (one native op, its gradient registered: eager and graphs outside XLA)
    against tf.custom_gradient around the kernel's statistics and the residual ops (the
    path under XLA and with a mask): r, var, mean, mean_lo, the input gradient and a
    second derivative (a Hessian-vector product) have the same bits, NaN and Inf channels
    and subnormal (flushed) differences included."""
    from tf_stable_moments import _layer, _moments

    x = tf.constant(_centre_channels(dtype))
    rng = np.random.default_rng(6)
    weights = [tf.constant(rng.normal(size=s).astype(dtype)) for s in (x.shape, (7,), (7,))]
    tangent = tf.constant(rng.normal(size=x.shape).astype(dtype))
    centre = _layer._backend_centre("tensorflow")

    def step(v):
        with tf.GradientTape() as outer:
            outer.watch(v)
            with tf.GradientTape() as inner:
                inner.watch(v)
                out = centre(v, None, (0, 1))
                safe = [tf.where(tf.math.is_finite(o), o, tf.zeros_like(o)) for o in out[:3]]
                loss = sum(tf.reduce_sum(o * w) for o, w in zip(safe, weights))
            grad = inner.gradient(loss, v)
            directional = tf.reduce_sum(tf.where(tf.math.is_finite(grad), grad, 0) * tangent)
        return (*out, grad, outer.gradient(directional, v))

    run = tf.function(step) if graph else step
    native = run(x)
    with monkeypatch.context() as patch:
        patch.setattr(_moments, "native_centre", lambda v, axes: None)
        run = tf.function(step) if graph else step
        composite = run(x)
    names = ("r", "var", "mean", "mean_lo", "gradient", "second derivative")
    for name, a, b in zip(names, native, composite, strict=True):
        _assert_same(a, b, name)
    assert not np.any(np.asarray(native[0])[..., 3])  # subnormal differences flushed


def test_masked_moments_are_exact_at_offset():
    rng = np.random.default_rng(1)
    x = _offset_data(1e6, shape=(8, 10, 4), seed=1)
    mask = rng.uniform(size=(8, 10)) < 0.3
    layer = StableBatchNormalization(momentum=0.0)
    y = layer(x, training=True, mask=mask)
    weights = np.broadcast_to(mask[..., None], x.shape)
    assert _max_error(y, _reference(x, weights=weights)) < F32_TOL
    for c in range(4):
        mean, var = exact_value(x[..., c][mask], np.float32)
        assert ulp_error(layer.moving_mean[c], mean, np.float32) <= 0.5
        assert ulp_error(layer.moving_variance[c], var, np.float32) <= 2


def test_moving_mean_update_is_lost_without_compensation():
    """At 1e6 (ulp 0.0625) a float32 moving mean drops steps below ~0.03; compensation doesn't."""
    x = np.full((8, 2), 1e6 + 0.5, np.float32)
    layers = [
        StableBatchNormalization(moving_mean_initializer=keras.initializers.Constant(1e6), **kw)
        for kw in ({}, {"compensated_moving_stats": True})
    ]
    steps = 200
    for layer in layers:
        for _ in range(steps):
            layer(x, training=True)
    exact = 1e6 + 0.5 * (1 - 0.99**steps)
    plain, compensated = layers
    assert np.all(np.abs(plain.moving_mean.numpy() - exact) > 0.4)
    parts = compensated.moving_mean.numpy(), compensated.moving_mean_correction.numpy()
    total = np.add(*parts, dtype=np.float64)
    np.testing.assert_allclose(total, exact, rtol=0, atol=1e-6)


def test_compensated_inference_subtracts_both_parts():
    layer = StableBatchNormalization(compensated_moving_stats=True)
    layer.build((512, 16))
    layer.moving_mean.assign(np.full(16, 1e6, np.float32))
    layer.moving_mean_correction.assign(np.full(16, 0.01, np.float32))
    x = _offset_data(1e6)
    y = layer(x, training=False)
    ref = (x.astype(np.float64) - (1e6 + np.float64(np.float32(0.01)))) / np.sqrt(1 + 1e-3)
    assert _max_error(y, ref) < F32_TOL


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_mixed_precision_statistics_in_float32(policy):
    layer = StableBatchNormalization(dtype=policy)
    half = layer.compute_dtype
    x = keras.ops.convert_to_numpy(keras.ops.cast(_offset_data(100.0, (64, 16)), half))
    y = layer(x, training=True)
    assert keras.backend.standardize_dtype(y.dtype) == half
    assert [w.dtype for w in layer.weights] == ["float32"] * 4
    ref = _reference(x.astype(np.float32))
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[half]  # one ulp at 1
    assert _max_error(y, ref) <= eps * np.abs(ref).max()
    expected = x.astype(np.float64).mean(0) * np.float32(1 - 0.99)
    np.testing.assert_allclose(layer.moving_mean.numpy(), expected, rtol=1e-6)


# ------------------------------------------------------------------ gradients
def _gradients(layer, x, g, **call_kwargs):
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(layer(x, training=True, **call_kwargs) * g)
    return [t.numpy() for t in tape.gradient(loss, [x, *layer.trainable_weights])]


def _pair_of_layers(shape, seed=2):
    rng = np.random.default_rng(seed)
    gamma = rng.uniform(0.5, 2.0, shape[-1]).astype(np.float32)
    beta = rng.standard_normal(shape[-1]).astype(np.float32)
    layers = []
    for cls in (keras.layers.BatchNormalization, StableBatchNormalization):
        layer = cls()
        layer.build(shape)
        layer.set_weights([gamma, beta, np.zeros_like(gamma), np.ones_like(gamma)])
        layers.append(layer)
    return layers


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_gradients_match_keras_on_benign_data(masked):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 5, 8)).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    kwargs = {"mask": rng.uniform(size=(64, 5)) < 0.7} if masked else {}
    theirs, ours = (_gradients(layer, x, g, **kwargs) for layer in _pair_of_layers(x.shape))
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_second_order_gradients_match_keras_on_benign_data():
    rng = np.random.default_rng(4)
    x = tf.constant(rng.standard_normal((64, 8)).astype(np.float32))
    g = rng.standard_normal((64, 8)).astype(np.float32)
    results = []
    for layer in _pair_of_layers(x.shape):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                loss = tf.reduce_sum(layer(x, training=True) * g)
            penalty = tf.reduce_sum(inner.gradient(loss, x) ** 2)
        results.append(outer.gradient(penalty, x).numpy())
    np.testing.assert_allclose(results[1], results[0], rtol=1e-3, atol=1e-4)


def _reference_input_gradient(x, g, gamma, weights, epsilon=1e-3):
    """d sum(g * y) / dx in float64: gamma s (g - (w / k) (sum g + xhat sum(g xhat)))."""
    x, g, w = (a.astype(np.float64) for a in (x, g, weights))
    axes = tuple(range(x.ndim - 1))
    k = w.sum(axes)
    mean = (w * x).sum(axes) / k
    s = 1 / np.sqrt((w * (x - mean) ** 2).sum(axes) / k + epsilon)
    xhat = (x - mean) * s
    return gamma * s * (g - w / k * (g.sum(axes) + xhat * (g * xhat).sum(axes)))


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
def test_gradients_are_accurate_at_offset_1e6(masked):
    rng = np.random.default_rng(5)
    x = _offset_data(1e6, shape=(64, 5, 8), seed=50)
    g = rng.standard_normal(x.shape).astype(np.float32)
    mask = rng.uniform(size=(64, 5)) < 0.7 if masked else np.ones((64, 5), bool)
    layer = _pair_of_layers(x.shape)[1]
    dx = _gradients(layer, x, g, mask=mask)[0]
    ref = _reference_input_gradient(
        x, g, layer.gamma.numpy(), np.broadcast_to(mask[..., None], x.shape)
    )
    assert np.all(np.isfinite(dx))
    assert np.max(np.abs(dx - ref)) < 1e-5 * np.max(np.abs(ref))


# ------------------------------------------------------------------ TensorFlow and JAX backends
BACKENDS = ("tensorflow", "jax")
BITWISE = (
    "plain_y1",
    "plain_y2",
    "plain_inference",
    "plain_moving_mean",
    "plain_moving_variance",
    "compensated_y1",
    "compensated_y2",
    "compensated_inference",
    "compensated_moving_mean",
    "compensated_moving_variance",
    "compensated_moving_mean_correction",
    "masked_y",
    "masked_moving_mean",
    "masked_moving_variance",
    "channels_first_y",
    "channels_first_moving_mean",
)


@pytest.fixture(scope="module")
def backend_inputs():
    rng = np.random.default_rng(6)
    return {
        "x": _offset_data(1e6, seed=6),
        "x2": _offset_data(1e6 + 0.5, seed=7),
        "gamma": rng.uniform(0.5, 2.0, 16).astype(np.float32),
        "beta": rng.standard_normal(16).astype(np.float32),
        "x_seq": _offset_data(1e6, shape=(8, 10, 16), seed=8),
        "mask": rng.uniform(size=(8, 10)) < 0.6,
        "x_nchw": _offset_data(-3e5, shape=(4, 16, 5, 5), seed=9),
        "benign": rng.standard_normal((64, 16)).astype(np.float32),
        "g": rng.standard_normal((64, 16)).astype(np.float32),
        "g_offset": rng.standard_normal((512, 16)).astype(np.float32),
    }


@pytest.fixture(scope="module")
def backend_outputs(backend_inputs, tmp_path_factory):
    """Run tests/_layer_backend_check.py under each backend, in parallel processes."""
    tmp = tmp_path_factory.mktemp("backends")
    np.savez(tmp / "inputs.npz", **backend_inputs)
    procs = {}
    for backend in BACKENDS:
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        procs[backend] = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "tests" / "_layer_backend_check.py"),
                str(tmp / "inputs.npz"),
                str(tmp / f"{backend}.npz"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    outputs = {}
    for backend, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{backend} subprocess failed:\n{log[-4000:]}"
        outputs[backend] = dict(np.load(tmp / f"{backend}.npz"))
        assert str(outputs[backend]["backend"]) == backend
    return outputs


@pytest.mark.parametrize("entry", BITWISE)
def test_tensorflow_and_jax_backends_agree_bitwise(backend_outputs, entry):
    tf_out, jax_out = (backend_outputs[b][entry] for b in BACKENDS)
    assert tf_out.dtype == jax_out.dtype == np.float32
    np.testing.assert_array_equal(tf_out.view(np.uint32), jax_out.view(np.uint32))


def test_backend_outputs_are_accurate(backend_outputs, backend_inputs):
    x, gamma, beta = (backend_inputs[k] for k in ("x", "gamma", "beta"))
    y = backend_outputs["jax"]["plain_y1"]
    assert _max_error(y, _reference(x, gamma, beta)) < F32_TOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_gradients(backend_outputs, backend_inputs, backend):
    out = backend_outputs[backend]
    np.testing.assert_allclose(
        out["grad_benign_ours"], out["grad_benign_keras"], rtol=1e-4, atol=1e-5
    )
    x = backend_inputs["x"]
    ref = _reference_input_gradient(
        x, backend_inputs["g_offset"], backend_inputs["gamma"], np.ones_like(x)
    )
    assert np.max(np.abs(out["grad_offset_ours"] - ref)) < 1e-5 * np.max(np.abs(ref))


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_fit_updates_moving_statistics_and_saves(backend_outputs, backend_inputs, backend):
    """Two full-batch steps with momentum 0.5 from (0, 1): moving = 0.75 * batch statistic."""
    out = backend_outputs[backend]
    x = backend_inputs["x"].astype(np.float64)
    np.testing.assert_allclose(out["fit_moving_mean"], 0.75 * x.mean(0), rtol=1e-6)
    np.testing.assert_allclose(out["fit_moving_variance"], 0.25 + 0.75 * x.var(0), rtol=1e-5)
    assert str(out["saved_class"]) == "StableBatchNormalization"
    np.testing.assert_array_equal(out["saved_loaded_predict"], out["saved_predict"])


# ------------------------------------------------------------------ keras BatchNormalization tests
RENORM_CLIPPING = {"rmax": 3.0, "rmin": 0.3, "dmax": 5.0}


@pytest.mark.parametrize(
    "init_kwargs, input_shape, trainable, non_trainable, losses",
    [
        ({}, (2, 3), 2, 2, 0),
        ({"center": False, "scale": False}, (2, 3), 0, 2, 0),
        ({"beta_regularizer": "l2", "gamma_regularizer": "l2"}, (2, 4, 4, 3), 2, 2, 2),
        ({"renorm": True, "renorm_clipping": RENORM_CLIPPING}, (2, 4, 4, 3), 2, 5, 0),
        ({"compensated_moving_stats": True}, (2, 3), 2, 3, 0),
    ],
    ids=["vector", "no_center_no_scale", "image_with_regularizers", "renorm", "compensated"],
)
@pytest.mark.filterwarnings("ignore:.*(shuffle=True|any trainable weights).*:UserWarning")
def test_keras_layer_checks(init_kwargs, input_shape, trainable, non_trainable, losses):
    """keras's run_layer_test: serialization, build, masking, a training step, mixed precision."""
    keras_testing.TestCase("run_layer_test").run_layer_test(
        StableBatchNormalization,
        init_kwargs=init_kwargs,
        input_shape=input_shape,
        call_kwargs={"training": True},
        expected_output_shape=input_shape,
        expected_num_trainable_weights=trainable,
        expected_num_non_trainable_weights=non_trainable,
        expected_num_losses=losses,
        expected_num_seed_generators=0,
        supports_masking=True,
    )


@pytest.mark.parametrize("initializer", ["zeros", "ones"])
@pytest.mark.parametrize("input_shape", [(5, 2, 3), (5, 3, 3, 2)], ids=["3d", "4d"])
@pytest.mark.parametrize("axis", [-1, 1], ids=["channels_last", "channels_first"])
def test_keras_correctness_scenario(axis, input_shape, initializer):
    layer = StableBatchNormalization(
        axis=axis,
        momentum=0,
        moving_mean_initializer=initializer,
        moving_variance_initializer=initializer,
    )
    x = np.random.default_rng(10).normal(5.0, 10.0, size=input_shape)
    out = x
    for _ in range(3):
        out = layer(out, training=True)
    broadcast = [1] * len(input_shape)
    broadcast[axis] = input_shape[axis]
    out = (out.numpy() - layer.beta.numpy().reshape(broadcast)) / layer.gamma.numpy().reshape(
        broadcast
    )
    axes = tuple(a for a in range(len(input_shape)) if a != axis % len(input_shape))
    np.testing.assert_allclose(out.mean(axes), 0.0, atol=1e-3)
    np.testing.assert_allclose(out.std(axes), 1.0, atol=1e-3)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.0, atol=1e-3)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 1.0, atol=1e-3)

    assert not np.allclose(layer(x, training=False), layer(x, training=True))
    training_out = layer(x, training=True)
    np.testing.assert_allclose(layer(x, training=False), training_out, rtol=1e-6, atol=1e-6)

    x[:, 1, :] = 0.0
    masked = keras.layers.Masking()(x)
    np.testing.assert_allclose(layer(masked, training=False), layer(x, training=False))
    unmasked_out = layer(x, training=False)
    assert not np.allclose(layer(masked, training=True), unmasked_out)


def test_fully_masked_input_gives_zeros():
    layer = StableBatchNormalization(scale=False, center=False)
    y = layer(np.zeros((4, 5)), mask=np.zeros((4,), np.float32), training=True)
    np.testing.assert_array_equal(y.numpy(), np.zeros((4, 5), np.float32))
    np.testing.assert_array_equal(layer.moving_variance.numpy(), np.full(5, 0.99, np.float32))


def test_masked_broadcast_normalization():
    layer = StableBatchNormalization(momentum=0.0)
    y = layer(np.ones((1, 2, 3, 4), np.float32), training=True, mask=np.ones((1, 2, 1)))
    np.testing.assert_array_equal(y.numpy(), np.zeros((1, 2, 3, 4), np.float32))
    np.testing.assert_array_equal(layer.moving_mean.numpy(), np.ones(4, np.float32))
    np.testing.assert_array_equal(layer.moving_variance.numpy(), np.zeros(4, np.float32))


@pytest.mark.parametrize("mask_value", [0.0, 1.0])
@pytest.mark.parametrize("run_eagerly", [True, False], ids=["run_eagerly", "tf_function"])
def test_fit_ignores_masked_values(run_eagerly, mask_value):
    data = np.array([[[1, 5], [2, 5], [mask_value] * 2, [mask_value] * 2]] * 10, dtype=np.float32)
    inputs = keras.Input((None, 2))
    outputs = StableBatchNormalization(momentum=0.0)(keras.layers.Masking(mask_value)(inputs))
    model = keras.Model(inputs, outputs)
    model.compile("rmsprop", loss="mse", run_eagerly=run_eagerly)
    model.fit(data, data, batch_size=10, epochs=2, verbose=0)
    np.testing.assert_array_equal(model.layers[2].moving_mean.numpy(), [1.5, 5.0])
    np.testing.assert_array_equal(model.layers[2].moving_variance.numpy(), [0.25, 0.0])


def test_trainable_false_runs_in_inference_mode():
    layer = StableBatchNormalization(axis=-1, momentum=0.8, epsilon=1e-7)
    layer.build((1, 4, 4, 3))
    layer.trainable = False
    assert (len(layer.weights), len(layer.trainable_weights)) == (4, 0)
    x = np.random.default_rng(11).normal(5.0, 10.0, size=(200, 4, 4, 3)).astype(np.float32)
    np.testing.assert_allclose(layer(x, training=True), x, rtol=1e-6)
    np.testing.assert_array_equal(layer.moving_mean.numpy(), np.zeros(3, np.float32))

    layer.trainable = True
    assert (len(layer.weights), len(layer.trainable_weights)) == (4, 2)
    for _ in range(10):
        out = layer(x, training=True).numpy()
    np.testing.assert_allclose(out.mean((0, 1, 2)), 0.0, atol=1e-3)
    np.testing.assert_allclose(out.std((0, 1, 2)), 1.0, atol=1e-3)


def test_renorm_stddev_initializer_and_inference():
    layer = StableBatchNormalization(
        renorm=True, moving_variance_initializer=keras.initializers.Constant(4.0)
    )
    layer.build((None, 5))
    np.testing.assert_array_equal(layer.moving_stddev.numpy(), np.full(5, 2.0, np.float32))
    np.testing.assert_array_equal(layer.renorm_stddev.numpy(), np.full(5, 2.0, np.float32))

    plain = StableBatchNormalization()
    plain.build((None, 5))
    weights = [np.random.default_rng(12).uniform(0.5, 2.0, 5).astype(np.float32)] * 4
    for target in (plain, layer):
        for name, value in zip(["gamma", "beta", "moving_mean", "moving_variance"], weights):
            getattr(target, name).assign(value)
    x = np.random.default_rng(13).normal(size=(4, 5)).astype(np.float32)
    np.testing.assert_array_equal(
        layer(x, training=False).numpy(), plain(x, training=False).numpy()
    )


def test_renorm_correctness():
    """keras's test_renorm_correctness, with its numbers."""
    rng = np.random.default_rng(14)
    epsilon, momentum, renorm_momentum = 1e-3, 0.9, 0.8
    layer = StableBatchNormalization(
        epsilon=epsilon, momentum=momentum, renorm=True, renorm_momentum=renorm_momentum
    )
    layer.build((None, 3))
    init = {
        "moving_mean": rng.normal(0.0, 1.0, 3),
        "moving_variance": np.abs(rng.normal(1.0, 0.5, 3)),
        "renorm_mean": rng.normal(0.0, 1.0, 3),
        "renorm_stddev": np.abs(rng.normal(1.0, 0.5, 3)),
        "gamma": rng.normal(1.0, 0.1, 3),
        "beta": rng.normal(0.0, 0.1, 3),
    }
    init["moving_stddev"] = np.sqrt(init["moving_variance"])
    for name, value in init.items():
        getattr(layer, name).assign(value.astype(np.float32))
    x = np.array([[4.0, 6.0, 2.0], [8.0, -2.0, 5.0], [6.0, 4.0, 3.0]], dtype=np.float32)
    mean, stddev = x.mean(0), np.sqrt(x.var(0) + epsilon)
    r = stddev / init["renorm_stddev"]
    d = (mean - init["renorm_mean"]) / init["renorm_stddev"]
    expected = (((x - mean) / stddev) * r + d) * init["gamma"] + init["beta"]
    np.testing.assert_allclose(layer(x, training=True), expected, atol=1e-5)

    def moved(old, new, m):
        return old * m + new * (1 - m)

    expected_stddev = moved(init["moving_stddev"], stddev, momentum)
    for name, value in {
        "renorm_mean": moved(init["renorm_mean"], mean, renorm_momentum),
        "renorm_stddev": moved(init["renorm_stddev"], stddev, renorm_momentum),
        "moving_mean": moved(init["moving_mean"], mean, momentum),
        "moving_stddev": expected_stddev,
        "moving_variance": expected_stddev**2 - epsilon,
    }.items():
        np.testing.assert_allclose(getattr(layer, name).numpy(), value, atol=1e-5, err_msg=name)


def test_large_moving_variance_within_autocast_scope():
    layer = StableBatchNormalization()
    layer.build((1, 4, 4, 3))
    with keras.src.backend.AutocastScope("float16"):
        layer.moving_variance.assign(keras.ops.full((3,), 70000))
        np.testing.assert_array_equal(layer.moving_variance.value.numpy(), np.full(3, 70000))


# ------------------------------------------------------------------ arguments and errors
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"renorm": True, "renorm_clipping": {"random_key": 1.0}}, "Received invalid keys"),
        ({"renorm": True, "renorm_clipping": {"rmax": 0.0, "rmin": 1.0}}, "rmax should be"),
        (
            {"renorm": True, "renorm_clipping": {"rmax": 1.0, "dmax": -1.0}},
            "dmax should be non-negative",
        ),
        ({"compensated_moving_stats": 1}, "compensated_moving_stats must be a bool"),
        ({"compensated_moving_stats": True, "renorm": True}, "not supported with renorm=True"),
    ],
    ids=[
        "renorm_clipping_keys",
        "renorm_rmax_below_rmin",
        "renorm_negative_dmax",
        "compensated_not_bool",
        "compensated_with_renorm",
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StableBatchNormalization(**kwargs)


def test_extra_argument_is_keyword_only():
    parameter = inspect.signature(StableBatchNormalization).parameters["compensated_moving_stats"]
    assert (parameter.kind, parameter.default) == (inspect.Parameter.KEYWORD_ONLY, False)


def test_unsupported_backend_raises(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(NotImplementedError, match="active Keras backend is 'torch'"):
        StableBatchNormalization()


def test_mask_of_wrong_rank_raises():
    with pytest.raises(ValueError, match="mask provided should be one dimension less"):
        StableBatchNormalization()(np.ones((2, 3), np.float32), mask=np.ones((2, 3)), training=True)


def test_synchronized_single_replica_matches_unsynchronized():
    x = _offset_data(1e6)
    y_sync = StableBatchNormalization(synchronized=True)(x, training=True)
    np.testing.assert_array_equal(
        y_sync.numpy(), StableBatchNormalization()(x, training=True).numpy()
    )


@pytest.fixture(scope="module")
def sync_outputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("sync") / "sync.npz"
    script = Path(__file__).with_name("_layer_sync_check.py")
    proc = subprocess.run(
        [sys.executable, str(script), str(path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return dict(np.load(path))


@pytest.mark.parametrize("case", ["plain", "masked", "ties"])
def test_synchronized_two_replicas_match_one_device(sync_outputs, case):
    """10 + 6 rows on a two-replica MirroredStrategy == 16 rows on one device, bit for bit
    (ties: a global near-tie that only the exact round decides, its mean_lo with it)."""
    out = {k.removeprefix(f"{case}_"): v for k, v in sync_outputs.items() if k.startswith(case)}
    for key in ("y", "moving"):
        np.testing.assert_array_equal(
            out[f"sync_{key}"].view(np.uint32), out[f"single_{key}"].view(np.uint32)
        )
    # The input gradient sums the replicas' contributions in another order: float32 tolerance.
    scale = np.abs(out["single_grad"]).max()
    np.testing.assert_allclose(out["sync_grad"], out["single_grad"], rtol=0, atol=4e-7 * scale)
    # Second order (a Hessian-vector product): the same, to float32 tolerance.
    scale = np.abs(out["single_hvp"]).max()
    np.testing.assert_allclose(out["sync_hvp"], out["single_hvp"], rtol=0, atol=1e-6 * scale)
    # Communication is independent of the batch on decided data (docs section 13b):
    # replica 0's collectives per call of the statistics are the certified merge's: the
    # shift [C] (float32: an input), the sums and smallest-magnitude exponent terms [3, C]
    # with the count, flat (float64: 3 C + 1), and a second round whose size is known
    # when it runs.  Unmasked (mean_lo): the square of the replica's row count rides in
    # the sums, and the second round is the int64 mean_lo sums [C] with the lanes of the
    # open slices' elements (none on decided data).  Masked (two calls without mean_lo, its selected
    # counts [C] int64 after the first): the open slices' packed states.  Then the [3, 4]
    # backward.
    merge = [(0, 4, 4), (0, 8, 13), (0, 8, -1)]
    expected = {
        "plain": [(0, 4, 4), (0, 8, 14), (0, 8, -1), (0, 4, 12)],
        "masked": merge + [(0, 8, 4)] + merge + [(0, 4, 12)],
    }
    expected = expected["plain" if case == "ties" else case]
    assert [tuple(row) for row in out["collectives"].tolist()] == expected


# ------------------------------------------------------------------ configuration and weights
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"renorm": True, "renorm_clipping": RENORM_CLIPPING, "renorm_momentum": 0.95},
        {"compensated_moving_stats": True, "axis": 1, "epsilon": 1e-5},
    ],
    ids=["default", "renorm", "compensated"],
)
def test_config_round_trip(kwargs):
    config = StableBatchNormalization(**kwargs).get_config()
    assert StableBatchNormalization.from_config(config).get_config() == config
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(StableBatchNormalization(**kwargs))
    )
    assert type(restored) is StableBatchNormalization
    assert restored.get_config() == {**config, "name": restored.name}


def test_config_is_keras_config_plus_compensation_flag():
    ours = StableBatchNormalization(momentum=0.9, name="bn").get_config()
    theirs = keras.layers.BatchNormalization(momentum=0.9, name="bn").get_config()
    assert ours == {**theirs, "compensated_moving_stats": False}
    assert StableBatchNormalization.from_config(theirs).get_config() == ours
    registered = keras.saving.serialize_keras_object(StableBatchNormalization())["registered_name"]
    assert registered == "tf_stable_moments>StableBatchNormalization"


def test_weights_have_keras_names_shapes_and_order():
    layers = _pair_of_layers((None, 8))
    theirs, ours = ([(w.name, w.shape, w.trainable) for w in layer.weights] for layer in layers)
    assert (
        ours
        == theirs
        == [
            ("gamma", (8,), True),
            ("beta", (8,), True),
            ("moving_mean", (8,), False),
            ("moving_variance", (8,), False),
        ]
    )
    x = np.random.default_rng(15).normal(size=(32, 8)).astype(np.float32)
    np.testing.assert_allclose(*(layer(x).numpy() for layer in layers), rtol=1e-5, atol=1e-6)


def test_compensated_weights_are_appended():
    layer = StableBatchNormalization(compensated_moving_stats=True)
    layer.build((None, 8))
    names = [w.name for w in layer.weights]
    assert names == ["gamma", "beta", "moving_mean", "moving_variance", "moving_mean_correction"]
    standard = _pair_of_layers((None, 8))[0].get_weights()
    with pytest.raises(ValueError, match="list of length 4, but the layer was expecting 5 weights"):
        layer.set_weights(standard)


def _small_model(*classes, seed=None):
    """Input(8), then Dense(8) and a normalization layer of each class; seeded weights."""
    layers = [keras.Input((8,))]
    for cls in classes:
        layers += [keras.layers.Dense(8), cls()]
    model = keras.Sequential(layers)
    if seed is not None:
        rng = np.random.default_rng(seed)
        model.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in model.weights])
    return model


def _assert_same_weights(a, b):
    for x, y in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_array_equal(x, y)


def test_load_weights_from_legacy_h5_of_keras_model(tmp_path):
    """Legacy .h5 files address layers by order: a BatchNormalization file loads 1:1."""
    theirs = _small_model(keras.layers.BatchNormalization, seed=16)
    theirs.save(tmp_path / "bn.h5")
    ours = _small_model(StableBatchNormalization)
    ours.load_weights(tmp_path / "bn.h5")
    _assert_same_weights(ours, theirs)


KERAS_BN = keras.layers.BatchNormalization


@pytest.mark.parametrize(
    "writer, reader",
    [
        ((KERAS_BN, KERAS_BN, KERAS_BN), (StableBatchNormalization,) * 3),
        ((KERAS_BN, KERAS_BN, KERAS_BN), (KERAS_BN, StableBatchNormalization, KERAS_BN)),
        ((StableBatchNormalization,) * 3, (KERAS_BN, KERAS_BN, KERAS_BN)),
    ],
    ids=["keras_to_ours", "keras_to_partly_replaced", "ours_to_keras"],
)
def test_native_weights_file_loads_across_the_classes(tmp_path, writer, reader):
    """Keras 3 .weights.h5 files address layers by snake-cased class name and count;
    the layer carries keras's class name, so files load 1:1 in both directions."""
    written = _small_model(*writer, seed=17)
    written.save_weights(tmp_path / "bn.weights.h5")
    read = _small_model(*reader)
    read.load_weights(tmp_path / "bn.weights.h5")
    _assert_same_weights(read, written)
    assert [type(layer) for layer in read.layers[1::2]] == list(reader)


def test_native_weights_file_of_keras_model_loads_with_compensation(tmp_path):
    written = _small_model(KERAS_BN, seed=18)
    written.save_weights(tmp_path / "bn.weights.h5")
    read = _small_model(lambda: StableBatchNormalization(compensated_moving_stats=True))
    read.layers[1].moving_mean_correction.assign(np.full(8, 0.25, np.float32))
    read.load_weights(tmp_path / "bn.weights.h5")
    *standard, correction = read.get_weights()
    for x, y in zip(standard, written.get_weights(), strict=True):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(correction, np.zeros(8, np.float32))


def test_class_identity_is_visible():
    layer = StableBatchNormalization(name="bn")
    assert repr(layer) == "<tf_stable_moments.StableBatchNormalization name=bn, built=False>"
    assert StableBatchNormalization.__qualname__ == "StableBatchNormalization"
    assert StableBatchNormalization.__name__ == "BatchNormalization"  # keras's weight-file key
    model = keras.Sequential([keras.Input((4,)), StableBatchNormalization()])
    assert type(pickle.loads(pickle.dumps(model)).layers[0]) is StableBatchNormalization


def test_exported_from_package():
    assert tf_stable_moments.StableBatchNormalization is StableBatchNormalization
    assert "StableBatchNormalization" in tf_stable_moments.__all__
