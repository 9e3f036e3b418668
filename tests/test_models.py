"""The package as users run it: the main job's stderr, the one-call swap, real models.

Subprocesses (the main job, the JAX backend) are started by module fixtures as
soon as a test that needs them is selected, so they run while the tests in this
process do.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


class _Background:
    """A subprocess writing to files (a full pipe would block it while other tests run)."""

    def __init__(self, args, env, cwd=ROOT):
        self.out = tempfile.TemporaryFile("w+")
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(args, stdout=self.out, stderr=self.err, env=env, cwd=cwd)

    def result(self, timeout=300):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read())
        return self.proc.returncode, *texts

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        self.err.close()


def _selected(request, prefix):
    return any(item.name.startswith(prefix) for item in request.session.items)


# ----------------------------------------------------------- the main job prints no warnings

# Lines TensorFlow's C++ runtime prints at start-up (not this package's code).
_RUNTIME_LINE = re.compile(r"^(WARNING: All log messages before absl::InitializeLog|[IWE]\d{4} )")


@pytest.fixture(scope="module")
def main_job(request, tmp_path_factory):
    """`python -m tf_stable_moments` on three files of one shape, in a subprocess."""
    if not _selected(request, "test_main_job"):
        yield None
        return
    folder = tmp_path_factory.mktemp("main_job")
    rng = np.random.default_rng(0)
    files = []
    for name in "abc":
        files.append(str(folder / f"{name}.npy"))
        np.save(files[-1], rng.normal(1e6, 1.0, (200, 8)).astype(np.float32))
    args = [sys.executable, "-m", "tf_stable_moments", "--input", *files, "--axes", "0"]
    job = _Background(args, _env())
    yield job
    job.close()


def test_main_job_prints_no_warnings(main_job):
    """Before the fix every dataset traced fresh tf.functions: 'triggered tf.function retracing'."""
    rc, out, err = main_job.result()
    assert rc == 0, out[-2000:] + err[-4000:]
    rows = [line for line in out.splitlines() if line.startswith(("a.npy", "b.npy", "c.npy"))]
    assert len(rows) == 3 and all(row.endswith("yes") for row in rows), out
    own = [line for line in err.splitlines() if line.strip() and not _RUNTIME_LINE.match(line)]
    assert not [line for line in own if re.search("warn|retracing", line, re.I)], err[-4000:]


# ------------------------------------------------------------------ stabilize(model): the swap


def _nested_model():
    """Functional: Dense, BN, a nested Sequential (Dense, BN), a nested functional (BN, LN)."""
    import keras

    inner_seq = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(6), keras.layers.BatchNormalization(momentum=0.9)],
        name="inner_sequential",
    )
    x_in = keras.Input((6,))
    inner_fn = keras.Model(
        x_in,
        keras.layers.LayerNormalization()(keras.layers.BatchNormalization(epsilon=1e-2)(x_in)),
        name="inner_functional",
    )
    inputs = keras.Input((5,))
    h = keras.layers.BatchNormalization(center=False)(keras.layers.Dense(6)(inputs))
    outputs = keras.layers.Dense(2)(inner_fn(inner_seq(h)))
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(21)
    for layer in model._flatten_layers(include_self=False):
        for v in layer.weights:  # moving variances positive, everything else N(0, 1)
            value = rng.normal(size=v.shape)
            v.assign(np.abs(value) + 0.5 if "variance" in v.name else value)
    return model


def _leaves(model):
    """The layers of model and of the models nested in it, without models and Input layers."""
    import keras

    return [
        layer
        for layer in model._flatten_layers(include_self=False)
        if not layer._layers and not isinstance(layer, keras.layers.InputLayer)
    ]


def test_stabilize_replaces_every_batch_normalization_of_a_nested_model():
    import keras

    import tf_stable_moments

    model = _nested_model()
    swapped = tf_stable_moments.stabilize(model)
    old, new = _leaves(model), _leaves(swapped)
    assert [layer.name for layer in old] == [layer.name for layer in new]
    stable = {
        keras.layers.BatchNormalization: tf_stable_moments.StableBatchNormalization,
        keras.layers.LayerNormalization: getattr(
            tf_stable_moments, "StableLayerNormalization", keras.layers.LayerNormalization
        ),
    }
    assert sum(type(layer) is keras.layers.BatchNormalization for layer in old) == 3
    for a, b in zip(old, new):
        assert type(b) is stable.get(type(a), type(a)), a.name
        assert b.get_config() == {**a.get_config(), **b.get_config()}, a.name  # config kept
        for x, y in zip(a.get_weights(), b.get_weights(), strict=True):
            np.testing.assert_array_equal(x, y, err_msg=a.name)
        assert all(v is not w for v, w in zip(a.weights, b.weights))  # copied, not shared
    assert [type(layer) for layer in _leaves(model)] == [type(layer) for layer in old]  # unchanged
    x = np.random.default_rng(22).normal(size=(64, 5)).astype(np.float32)
    for training in (False, True):
        np.testing.assert_allclose(
            swapped(x, training=training), model(x, training=training), rtol=1e-4, atol=1e-4
        )


def test_stabilize_keeps_the_operations_of_a_functional_model():
    """`h + a` between KerasTensors is an operation, not a layer: cloned, no weights to
    copy (a residual pre-LN block failed with "'Add' object has no attribute 'weights'")."""
    import keras

    import tf_stable_moments

    inputs = keras.Input((4, 8))
    h = keras.layers.LayerNormalization()(inputs)
    h = inputs + keras.layers.Dense(8)(h)
    model = keras.Model(inputs, keras.ops.mean(h, axis=1))
    swapped = tf_stable_moments.stabilize(model)
    kinds = [type(layer) for layer in _leaves(swapped)]
    assert kinds == [tf_stable_moments.StableLayerNormalization, keras.layers.Dense]
    x = np.random.default_rng(23).normal(1e4, 1.0, (2, 4, 8)).astype(np.float32)
    np.testing.assert_allclose(swapped(x), model(x), rtol=1e-4, atol=1e-3)


def test_stabilize_rejects_what_it_cannot_swap():
    import keras

    import tf_stable_moments

    class Subclassed(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.bn = keras.layers.BatchNormalization()
            self.blocks = {"ln": [keras.layers.Dense(3), keras.layers.LayerNormalization()]}

        def call(self, x):
            return self.blocks["ln"][1](self.blocks["ln"][0](self.bn(x)))

    with pytest.raises(TypeError, match=r"model must be a keras.Model .*received model=.*Dense"):
        tf_stable_moments.stabilize(keras.layers.Dense(2))
    # The error says where the layers are and what to construct instead.
    want = (
        r"model='subclassed' is a subclassed model of class Subclassed: .* layers: self\.bn "
        r"\(BatchNormalization\), self\.blocks\['ln'\]\[1\] \(LayerNormalization\)\.  In its "
        r"__init__, construct tf_stable_moments\.StableBatchNormalization / "
        r"StableLayerNormalization .*new_layer\.set_weights\(old_layer\.get_weights\(\)\)"
    )
    with pytest.raises(ValueError, match=want):
        tf_stable_moments.stabilize(Subclassed(name="subclassed"))
    inputs = keras.Input((3,))
    outer = keras.Model(inputs, Subclassed(name="inner")(inputs))
    with pytest.raises(ValueError, match="the nested model 'inner' is a subclassed model"):
        tf_stable_moments.stabilize(outer)


def test_stabilize_can_turn_on_compensated_moving_stats():
    import keras

    import tf_stable_moments

    model = _nested_model()
    swapped = tf_stable_moments.stabilize(model, compensated_moving_stats=True)
    bns = [layer for layer in _leaves(swapped) if hasattr(layer, "compensated_moving_stats")]
    assert len(bns) == 3 and all(layer.compensated_moving_stats for layer in bns)
    for layer in bns:
        np.testing.assert_array_equal(layer.moving_mean_correction, np.zeros(6, np.float32))
    with pytest.raises(ValueError, match="compensated_moving_stats must be a bool; .*='yes'"):
        tf_stable_moments.stabilize(
            keras.Sequential([keras.Input((2,))]), compensated_moving_stats="yes"
        )


# ------------------------------------- the default compensated_moving_stats=False, at 1e6


def _stalled_layer_run(compensated, offset=1e6, steps=100, fit=None):
    """Train one layer on N(offset, 1) from a moving mean 2 below, eagerly or by `fit`
    ("tf_function" or "jit_compile"); returns (layer, warnings)."""
    import warnings

    import keras

    import tf_stable_moments

    rng = np.random.default_rng(31)
    x = rng.normal(offset, 1.0, (steps * 64, 4)).astype(np.float32)
    layer = tf_stable_moments.StableBatchNormalization(
        momentum=0.9,
        compensated_moving_stats=compensated,
        moving_mean_initializer=keras.initializers.Constant(offset - 2),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fit:
            model = keras.Sequential([keras.Input((4,)), layer])
            model.compile("sgd", "mse", jit_compile=fit == "jit_compile")
            model.fit(x, np.zeros_like(x), batch_size=64, shuffle=False, verbose=0)
        else:
            for i in range(steps):
                layer(x[64 * i : 64 * (i + 1)], training=True)
    stalls = [str(w.message) for w in caught if "cannot follow the batch mean" in str(w.message)]
    return layer, stalls


@pytest.mark.parametrize(
    "fit",
    # under jit_compile the warning comes from the native check (an XLA custom call)
    [None, "tf_function", pytest.param("jit_compile", marks=pytest.mark.native)],
    ids=["eager", "fit_tf_function", "fit_jit"],
)
def test_default_moving_mean_stalls_at_1e6_and_warns_once(fit):
    """momentum 0.9 at 1e6: updates below 0.03125 / 0.1 = 0.31 are lost; one warning says so
    (under jit_compile from the native check inside the XLA computation)."""
    layer, stalls = _stalled_layer_run(False, fit=fit)
    assert len(stalls) == 1, stalls
    assert re.search(r"below half an ulp of the moving mean \(0\.0312\)", stalls[0]), stalls[0]
    assert "compensated_moving_stats=True" in stalls[0]
    x = np.random.default_rng(32).normal(1e6, 1.0, (4096, 4)).astype(np.float32)
    off = np.abs(np.mean(np.asarray(layer(x, training=False)), axis=0))
    assert np.max(off) > 0.2, off  # inference shifted by the stalled moving mean


def test_stall_warns_once_from_a_graph_without_the_native_op(monkeypatch):
    """Without the native op (switched off, or a machine without the library) a graph's
    check is one traced function per dtype, a tf.cond calling back into Python only when
    a channel stalls: fit under tf.function warns once, as the native op does."""
    monkeypatch.setenv("TF_STABLE_MOMENTS_NATIVE", "0")
    layer, stalls = _stalled_layer_run(False, fit="tf_function")
    assert len(stalls) == 1, stalls
    assert re.search(r"below half an ulp of the moving mean \(0\.0312\)", stalls[0]), stalls[0]
    assert f"'{layer.name}'" in stalls[0]


def test_compensated_moving_mean_follows_at_1e6_without_warning():
    layer, stalls = _stalled_layer_run(True)
    assert stalls == []
    x = np.random.default_rng(32).normal(1e6, 1.0, (4096, 4)).astype(np.float32)
    off = np.abs(np.mean(np.asarray(layer(x, training=False)), axis=0))
    assert np.max(off) < 0.1, off


def test_no_stall_warning_for_harmless_losses_at_offset_100():
    """Batch means 1.5e-5 above a moving mean of 100: the update (1.5e-6) is below half an
    ulp (3.8e-6) and lost, but the loss is 1.5e-5 standard deviations: no warning."""
    import warnings

    import keras

    import tf_stable_moments

    z = np.random.default_rng(33).normal(size=(64, 4))
    x = (100 + 1.5e-5 + (z - z.mean(axis=0))).astype(np.float32)
    layer = tf_stable_moments.StableBatchNormalization(
        momentum=0.9, moving_mean_initializer=keras.initializers.Constant(100.0)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            layer(x, training=True)
    np.testing.assert_array_equal(layer.moving_mean, np.full(4, 100, np.float32))  # it stalled


# ------------------------------------------- mixed_bfloat16: an input BN's inputs are cast


def test_mixed_bfloat16_cast_of_float32_inputs_warns_once():
    import warnings

    import keras

    import tf_stable_moments

    x = np.random.default_rng(41).normal(1e6, 1.0, (64, 4)).astype(np.float32)
    layer = tf_stable_moments.StableBatchNormalization(dtype="mixed_bfloat16")
    with pytest.warns(UserWarning, match=r"casts its float32 inputs to bfloat16 .*dtype='float32'"):
        y = layer(x, training=True)
    assert np.all(np.asarray(keras.ops.cast(y, "float32")) == 0)  # N(1e6, 1) is constant in bf16
    kept = tf_stable_moments.StableBatchNormalization(dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer(x, training=True)  # once per layer
        layer(keras.ops.cast(x - 1e6, "bfloat16"), training=True)  # already 16-bit: no cast
        y = kept(x, training=True)  # the remedy the warning names
    assert 0.5 < float(np.std(np.asarray(y))) < 1.5


# ------------------------------ a real architecture, every BN swapped: fit, save, load


def _mobilenet(stem):
    """keras.applications.MobileNet(alpha=0.25) at 32x32 (27 BatchNormalization layers),
    or its stem (conv1 ... conv_pw_1: 3 of them) with a pooling and a Dense head."""
    import keras

    keras.utils.set_random_seed(0)
    base = keras.applications.MobileNet(
        weights=None, input_shape=(32, 32, 3), alpha=0.25, classes=4
    )
    if not stem:
        return base
    inputs = keras.Input((32, 32, 3))
    features = keras.Model(base.input, base.get_layer("conv_pw_1_relu").output)(inputs)
    pooled = keras.layers.GlobalAveragePooling2D()(features)
    return keras.Model(inputs, keras.layers.Dense(4, activation="softmax")(pooled))


@pytest.mark.parametrize(
    "mode, stem", [("eager", False), ("tf_function", True), ("jit_compile", True)]
)
def test_real_architecture_fits_a_partial_last_batch_and_reloads(tmp_path, mode, stem):
    """TensorFlow backend.  The whole model eagerly; in tf.function and with
    jit_compile=True (issue 15's crash: a new batch size inside the user's XLA function)
    its stem: tracing the kernel for 27 layers and 2 batch sizes takes ~25 s of the CI
    budget, and under XLA the kernel compiles per BN layer and batch size (~3 s of CPU
    each, benchmarks/models.py), too slow for the whole model in CI."""
    import keras

    import tf_stable_moments

    model = tf_stable_moments.stabilize(_mobilenet(stem))
    bns = [layer for layer in _leaves(model) if isinstance(layer, keras.layers.BatchNormalization)]
    assert len(bns) == (3 if stem else 27)
    assert {type(b) for b in bns} == {tf_stable_moments.StableBatchNormalization}
    model.compile(
        "sgd",
        keras.losses.SparseCategoricalCrossentropy(),
        run_eagerly=mode == "eager",
        jit_compile=mode == "jit_compile",
    )
    rng = np.random.default_rng(42)
    x = rng.normal(size=(12, 32, 32, 3)).astype(np.float32)
    y = np.arange(12) % 4
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # batches of 8 and 4
    assert np.isfinite(history.history["loss"][0])
    assert all(np.any(b.moving_mean.numpy() != 0) for b in bns)  # the statistics moved
    model.save(tmp_path / "model.keras")
    loaded = keras.saving.load_model(tmp_path / "model.keras")
    before, after = (m.predict(x[:8], batch_size=8, verbose=0) for m in (model, loaded))
    np.testing.assert_array_equal(before.view(np.uint32), after.view(np.uint32))


# ------------------------------------------------------- the JAX backend, in a subprocess


@pytest.fixture(scope="module")
def jax_process(request, tmp_path_factory):
    if not _selected(request, "test_jax_backend"):
        yield None
        return
    import keras

    import tf_stable_moments

    folder = tmp_path_factory.mktemp("jax")
    model = keras.Sequential([keras.Input((3,)), tf_stable_moments.StableBatchNormalization()])
    model.save(folder / "tiny.keras")
    script = str(ROOT / "tests" / "_models_check.py")
    args = [sys.executable, script, str(folder / "tiny.keras"), str(folder)]
    job = _Background(args, _env(KERAS_BACKEND="jax"))
    yield job
    job.close()


@pytest.fixture(scope="module")
def jax_result(jax_process):
    rc, out, err = jax_process.result()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert rc == 0 and lines, out[-2000:] + err[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_jax_backend_import_does_not_import_tensorflow(jax_result):
    assert jax_result["tensorflow_after_import"] is False
    assert jax_result["tensorflow_after_layer"] is False  # training and inference calls


def test_jax_backend_load_without_the_import_names_the_package(jax_result):
    """Keras builds the message from the class __name__ ('BatchNormalization', kept for
    weight files); the config it shows names the module to import and our class."""
    error = jax_result["load_error"]
    assert error is not None
    assert "'module': 'tf_stable_moments', 'class_name': 'BatchNormalization'" in error
    assert "'registered_name': 'tf_stable_moments>StableBatchNormalization'" in error
    assert jax_result["loaded_type"] == "StableBatchNormalization"  # after the import


@pytest.mark.native
def test_jax_backend_stall_warns_once_under_jit_from_one_custom_call(jax_result):
    """The default layer at 1e6 under fit (jit) warns once, the compensated one never; the
    check is one FFI call (a lax.cond with a callback cost ~0.5 ms per layer and step)."""
    stall = jax_result["stall"]
    assert stall["warnings_compensated_False"] == 1, stall
    assert stall["warnings_compensated_True"] == 0, stall
    assert stall["ffi_check"] and not stall["cond"], stall


@pytest.mark.native
def test_jax_backend_step_on_the_cpu_is_native_calls_and_on_a_device_none(jax_result):
    """A BN layer's gradient step lowered for the CPU takes its statistics, mean_lo and the
    output formulas' per-channel t = rsqrt32(var + eps) from native FFI calls (as the
    XLA kernel and formula they were seconds of a ResNet50's first step); lowered for a
    GPU or TPU it holds none (the XLA kernel and formulas: no host call)."""
    calls = jax_result["step_calls"]
    assert calls["cpu"] == [
        "tf_stable_moments_native_mean_lo",
        "tf_stable_moments_native_moments",
        "tf_stable_moments_native_rsqrt",
    ], calls
    assert calls["cuda"] == calls["tpu"] == [], calls


def test_jax_backend_fit_partial_last_batch_and_reload(jax_result):
    fit = jax_result["fit"]
    assert fit["bn_classes"] == ["StableBatchNormalization"] * 3
    assert fit["finite"] and all(np.isfinite(fit["loss"]))
    assert fit["same_bits"]
    assert fit["original_still_runs"]  # stabilize copied the weights (fit donates buffers)
