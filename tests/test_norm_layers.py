"""StableLayerNormalization and StableGroupNormalization: accuracy, backends, Keras compatibility.

TensorFlow backend in this process (eager, tf.function, jit_compile); the JAX
backend in a subprocess (tests/_norm_backend_check.py, whose `results` also
runs here for the TensorFlow side), compared bit for bit.  keras's own test
classes for the two layers run with our classes in place of keras's.
"""

import importlib
import importlib.util
import os
import pickle
import subprocess
import sys
import types
import unittest
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_stable_moments
from tf_stable_moments import (
    StableGroupNormalization,
    StableLayerNormalization,
    StableNormalization,
    _normalization,
)
from tf_stable_moments._oracle import exact_value

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _norm_backend_check as check  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODES = ("eager", "tf_function", "jit_compile")
F32_TOL = 1e-5
EPSILON = 1e-3
OURS = {"ln": StableLayerNormalization, "gn": StableGroupNormalization, "norm": StableNormalization}
THEIRS = {
    "ln": keras.layers.LayerNormalization,
    "gn": keras.layers.GroupNormalization,
    "norm": keras.layers.Normalization,
}

pytestmark = [
    pytest.mark.skipif(
        keras.backend.backend() != "tensorflow",
        reason="in-process tests use the TensorFlow backend",
    ),
    pytest.mark.filterwarnings("ignore:.*(rms_scaling=True|shuffle=True).*:UserWarning"),
]


# ------------------------------------------------------------------ data and references
def _normal(rng, offset, shape):
    return (offset + rng.standard_normal(shape)).astype(np.float32)


def _make_inputs():
    """The inputs of every test here and of the JAX subprocess.

    x_ln [20, 512] (LayerNormalization over the 512 features of each row):
    rows 0-7 N(1e6, 1), rows 8-15 N(1e7, 1), rows 16-17 constant (1e10 and
    -3.25), row 18 N(1e6, 1) with one NaN, row 19 N(0, 1).
    x_gn [10, 4, 4, 32] (8 groups of 4 channels: slices of 64 values):
    samples 0-3 N(1e6, 1), 4-7 N(1e7, 1), 8 constant 1e10, 9 N(1e6, 1) with a
    NaN in group 2 only.
    """
    rng = np.random.default_rng(20)
    x_ln = np.concatenate(
        [
            _normal(rng, 1e6, (8, 512)),
            _normal(rng, 1e7, (8, 512)),
            np.full((1, 512), 1e10, np.float32),
            np.full((1, 512), -3.25, np.float32),
            _normal(rng, 1e6, (1, 512)),
            _normal(rng, 0.0, (1, 512)),
        ]
    )
    x_ln[18, 100] = np.nan
    x_gn = np.concatenate(
        [
            _normal(rng, 1e6, (4, 4, 4, 32)),
            _normal(rng, 1e7, (4, 4, 4, 32)),
            np.full((1, 4, 4, 32), 1e10, np.float32),
            _normal(rng, 1e6, (1, 4, 4, 32)),
        ]
    )
    x_gn[9, 1, 2, 9] = np.nan  # channel 9: group 2 of 8
    inputs = {"x_ln": x_ln, "x_gn": x_gn}
    for name, size in (("ln", 512), ("gn", 32), ("benign_ln", 16), ("benign_gn", 8)):
        inputs[f"{name}_gamma"] = rng.uniform(0.5, 2.0, size).astype(np.float32)
        inputs[f"{name}_beta"] = rng.standard_normal(size).astype(np.float32)
    inputs.update(
        x_ln3=_normal(rng, -3e5, (6, 5, 16)),
        x_gn_nchw=_normal(rng, 1e6, (3, 8, 5, 5)),
        benign_ln=_normal(rng, 0.0, (32, 16)),
        g_ln=_normal(rng, 0.0, (32, 16)),
        benign_gn=_normal(rng, 0.0, (6, 5, 5, 8)),
        g_gn=_normal(rng, 0.0, (6, 5, 5, 8)),
        g_offset_ln=_normal(rng, 0.0, (20, 512)),
        fit_x=_normal(rng, 0.0, (64, 6)),
        fit_y=_normal(rng, 0.0, (64, 8)),
    )
    return inputs


INPUTS = _make_inputs()
# Rows (LN) or samples (GN) of each kind in x_ln / x_gn.
KINDS = {
    "ln": {"1e6": slice(0, 8), "1e7": slice(8, 16), "constant": slice(16, 18), "nan": 18},
    "gn": {"1e6": slice(0, 4), "1e7": slice(4, 8), "constant": slice(8, 9), "nan": 9},
}


def _groups(x, groups):
    """[B, ..., C] -> [B, ..., groups, C / groups]."""
    return x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)


def _reference(name, x):
    """The layer's formula in float64 on the float32 inputs (gamma, beta of INPUTS)."""
    gamma, beta = (INPUTS[f"{name}_{w}"].astype(np.float64) for w in ("gamma", "beta"))
    x = x.astype(np.float64)
    if name == "ln":
        axes, xs = (-1,), x
    else:
        xs = _groups(x, check.GROUPS)
        axes = tuple(range(1, xs.ndim - 2)) + (xs.ndim - 1,)
    mean = xs.mean(axes, keepdims=True)
    var = ((xs - mean) ** 2).mean(axes, keepdims=True)
    return ((xs - mean) / np.sqrt(var + EPSILON)).reshape(x.shape) * gamma + beta


def _errors(name, y):
    """{kind: max |y - float64 reference|} over the offset rows/samples of x_name."""
    ref = _reference(name, INPUTS[f"x_{name}"])
    y = np.asarray(y, np.float64)
    return {
        k: float(np.max(np.abs(y[KINDS[name][k]] - ref[KINDS[name][k]]))) for k in ("1e6", "1e7")
    }


def _assert_special_slices(name, y):
    """Constant slices give exactly beta; NaN reaches exactly the slices that hold one."""
    beta = INPUTS[f"{name}_beta"]
    constant = y[KINDS[name]["constant"]]
    np.testing.assert_array_equal(
        constant.view(np.uint32), np.broadcast_to(beta, constant.shape).view(np.uint32)
    )
    ref = _reference(name, INPUTS[f"x_{name}"])
    nan = KINDS[name]["nan"]
    np.testing.assert_array_equal(np.isnan(y[nan]), np.isnan(ref[nan]))
    assert 0 < np.isnan(y[nan]).mean() <= (1 if name == "ln" else 1 / check.GROUPS)
    finite = ~np.isnan(ref[nan])
    assert np.max(np.abs(y[nan][finite] - ref[nan][finite]), initial=0) < F32_TOL


def _outputs(mode):
    """{name: (our output, keras's output)} for LN and GN on x_ln / x_gn, in one function."""
    layers = check.accuracy_layers(INPUTS)

    def fn(x_ln, x_gn):
        xs = {"ln": x_ln, "gn": x_gn}
        return {
            name: (ours(xs[name]), theirs(xs[name])) for name, (theirs, ours, _) in layers.items()
        }

    if mode != "eager":
        fn = tf.function(fn, jit_compile=mode == "jit_compile")  # one compilation for all four
    out = fn(tf.constant(INPUTS["x_ln"]), tf.constant(INPUTS["x_gn"]))
    return {name: tuple(np.asarray(y) for y in pair) for name, pair in out.items()}


# ------------------------------------------------------------------ accuracy on offset data
@pytest.mark.parametrize("mode", MODES)
def test_output_matches_float64_and_keras_does_not(mode):
    """N(1e6, 1) and N(1e7, 1) slices within 1e-5 of float64; keras's layer > 1e-2 beside it;
    constant slices give exactly beta; a NaN changes no other slice."""
    for name, (ours, theirs) in _outputs(mode).items():
        assert max(_errors(name, ours).values()) < F32_TOL, (name, _errors(name, ours))
        _assert_special_slices(name, ours)
        assert min(_errors(name, theirs).values()) > 1e-2, (name, _errors(name, theirs))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("name", ["ln", "gn"])
def test_mixed_precision_statistics_in_float32(name, policy):
    kwargs = {"groups": 4} if name == "gn" else {}
    layer = OURS[name](dtype=policy, **kwargs)
    half = layer.compute_dtype
    x = keras.ops.convert_to_numpy(
        keras.ops.cast(_normal(np.random.default_rng(21), 100.0, (8, 3, 16)), half)
    )
    y = layer(x)
    assert keras.backend.standardize_dtype(y.dtype) == half
    assert [w.dtype for w in layer.weights] == ["float32"] * 2
    x64 = x.astype(np.float64)
    xs = x64 if name == "ln" else _groups(x64, 4)
    axes = (-1,) if name == "ln" else (1, 3)
    mean, var = xs.mean(axes, keepdims=True), xs.var(axes, keepdims=True)
    ref = ((xs - mean) / np.sqrt(var + EPSILON)).reshape(x.shape)
    ulp_at_1 = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[half]
    assert np.max(np.abs(np.asarray(y, np.float64) - ref)) <= ulp_at_1 * np.abs(ref).max()


@pytest.mark.parametrize("name", ["ln", "gn"])
def test_constant_input_without_beta_gives_zero(name):
    kwargs = {"groups": 4} if name == "gn" else {}
    x = np.full((3, 4, 8), -2.5e9, np.float32)
    y = OURS[name](center=False, gamma_initializer="ones", **kwargs)(x)
    np.testing.assert_array_equal(np.asarray(y).view(np.uint32), np.zeros(x.shape, np.uint32))


# ------------------------------------------------------------------ TensorFlow and JAX backends
@pytest.fixture(scope="module")
def backend_outputs(tmp_path_factory):
    """{backend: results}: the JAX subprocess and, while it runs, the same code here."""
    tmp = tmp_path_factory.mktemp("norm_backends")
    np.savez(tmp / "inputs.npz", **INPUTS)
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "tests" / "_norm_backend_check.py"),
            str(tmp / "inputs.npz"),
            str(tmp / "jax.npz"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    outputs = {"tensorflow": check.results(INPUTS)}
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"jax subprocess failed:\n{log[-4000:]}"
    outputs["jax"] = dict(np.load(tmp / "jax.npz"))
    for backend, out in outputs.items():
        assert str(out["backend"]) == backend
    return outputs


BITWISE = (
    "functional_mean",
    "functional_var",
    "ln",
    "gn",
    "ln_axes_12",
    "ln_rms_scaling",
    "gn_channels_first",
    "norm",
    "norm_weights",
    "norm_invert",
)


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_normalization_adapted_output_matches_float64_on_both_backends(backend_outputs, backend):
    """StableNormalization adapted in batches: output within 1e-5 of float64 at 1e6 and 1e7,
    and invert(output) back at the data to within the float32 ulp of the offset."""
    x = check.normalization_data()
    x64 = x.astype(np.float64)
    want = (x64 - x64.mean(0)) / np.sqrt(x64.var(0))
    out = backend_outputs[backend]
    assert np.max(np.abs(out["norm"] - want)) < 1e-5
    ulp = np.spacing(np.abs(x).max(0))
    assert np.all(np.abs(out["norm_invert"] - x).max(0) <= 2 * ulp)


@pytest.mark.parametrize("entry", BITWISE)
def test_tensorflow_and_jax_backends_agree_bitwise(backend_outputs, entry):
    tf_out, jax_out = (backend_outputs[b][entry] for b in ("tensorflow", "jax"))
    assert tf_out.dtype == jax_out.dtype == np.float32
    # NaN slices compare as NaN (their payload is not part of the contract).
    tf_bits, jax_bits = (
        np.where(np.isnan(a), np.float32(np.nan), a).view(np.uint32) for a in (tf_out, jax_out)
    )
    np.testing.assert_array_equal(tf_bits, jax_bits)


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_jax_backend_output_matches_float64_and_keras_does_not(backend_outputs, mode):
    """As on TensorFlow; keras's layers are measured beside ours under jax.jit."""
    out = backend_outputs["jax"]
    for name in ("ln", "gn"):
        ours = out[name if mode == "eager" else f"jit_{name}"]
        assert max(_errors(name, ours).values()) < F32_TOL, (name, _errors(name, ours))
        _assert_special_slices(name, ours)
    for name in ("ln", "gn"):
        theirs = out[f"jit_keras_{name}"]
        assert min(_errors(name, theirs).values()) > 1e-2, (name, _errors(name, theirs))


def test_variants_match_float64(backend_outputs):
    """The axis, rms_scaling, channels-first and instance variants, against float64."""
    out = backend_outputs["tensorflow"]
    x3 = INPUTS["x_ln3"].astype(np.float64)
    nchw = INPUTS["x_gn_nchw"].astype(np.float64)

    def norm(x, axes, centred=True):
        mean = x.mean(axes, keepdims=True) if centred else 0
        return (x - mean) / np.sqrt(x.var(axes, keepdims=True) + EPSILON)

    grouped = nchw.reshape(3, 4, 2, 5, 5)
    expected = {
        "ln_axes_12": norm(x3, (1, 2)),
        "ln_rms_scaling": norm(x3, (2,), centred=False),
        "gn_channels_first": norm(grouped, (2, 3, 4)).reshape(nchw.shape),
    }
    for entry, ref in expected.items():
        scale = np.abs(ref).max() if entry == "ln_rms_scaling" else 1.0
        assert np.max(np.abs(out[entry] - ref)) < F32_TOL * scale, entry


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
@pytest.mark.parametrize("name", ["ln", "gn"])
def test_gradients_match_keras_on_benign_data(backend_outputs, backend, name):
    out = backend_outputs[backend]
    for part in ("x", "gamma", "beta"):
        ours, theirs = (out[f"grad_{name}_{who}_{part}"] for who in ("ours", "keras"))
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5, err_msg=part)


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_gradients_are_accurate_at_offset(backend_outputs, backend):
    """d sum(g y) / dx = s (g' - mean(g') - xhat mean(g' xhat)), g' = g gamma, per row."""
    x, g = (
        INPUTS["x_ln"].astype(np.float64),
        INPUTS["g_offset_ln"] * INPUTS["ln_gamma"].astype(np.float64),
    )
    mean = x.mean(-1, keepdims=True)
    s = 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + EPSILON)
    xhat = (x - mean) * s
    ref = s * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    dx = backend_outputs[backend]["grad_offset_ln_x"]
    finite = slice(0, 18)  # rows 18 (NaN) and 19 (N(0, 1)) aside
    assert np.max(np.abs(dx[finite] - ref[finite])) < 1e-5 * np.max(np.abs(ref[finite]))
    assert np.all(np.isnan(dx[18])) and np.all(np.isfinite(np.delete(dx, 18, axis=0)))


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_fit_and_keras_file_round_trip(backend_outputs, backend):
    out = backend_outputs[backend]
    assert list(out["saved_classes"]) == ["StableLayerNormalization", "StableGroupNormalization"]
    np.testing.assert_array_equal(out["saved_loaded_predict"], out["saved_predict"])
    initial = {"gamma": 1.0, "beta": 0.0}
    for key, value in out.items():
        weight = key.rsplit("_", 1)[-1]
        if key.startswith("fit_") and weight in initial:
            assert np.all(np.isfinite(value))
            assert not np.allclose(value, initial[weight]), key  # the fit moved it
    other = backend_outputs["jax" if backend == "tensorflow" else "tensorflow"]
    for key in (k for k in out if k.startswith("fit_")):
        np.testing.assert_allclose(out[key], other[key], rtol=1e-5, atol=1e-6, err_msg=key)


# ------------------------------------------------------------------ keras's own tests
def _keras_tests(module, cls):
    """keras's test class for the layer, its module's `layers` holding our class instead."""
    return importlib.import_module(f"keras.src.layers.normalization.{module}"), cls


KERAS_TESTS = {
    "ln": _keras_tests("layer_normalization_test", "LayerNormalizationTest"),
    "gn": _keras_tests("group_normalization_test", "GroupNormalizationTest"),
    "norm": (
        importlib.import_module("keras.src.layers.preprocessing.normalization_test"),
        "NormalizationTest",
    ),
}


# StableNormalization's documented fourth weight (mean_correction): keras's basics test
# counts three non-trainable weights; everything before that check in it passes.
DEVIATIONS = {("norm", "test_normalization_basics"): "4 != 3 : Unexpected number of non_trainable"}


def _runs_here(fn):
    """False for keras tests that keras itself skips here (other backends, grain missing)."""
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "skipif" and mark.args and mark.args[0]:
            return False
    return not ("grain" in fn.__name__ and importlib.util.find_spec("grain") is None)


def _keras_test_cases():
    for name, (module, cls) in KERAS_TESTS.items():
        test_class = getattr(module, cls)
        for method in unittest.TestLoader().getTestCaseNames(test_class):
            if _runs_here(getattr(test_class, method)):
                yield pytest.param(name, method, id=f"{name}-{method}")


@pytest.mark.parametrize("name, method", list(_keras_test_cases()))
def test_keras_own_test_passes_with_our_class(monkeypatch, name, method):
    """keras's tests for LayerNormalization / GroupNormalization (argument validation, axis
    variants, run_layer_test: serialization, masking, fit, mixed precision) with our class."""
    module, cls = KERAS_TESTS[name]
    original = THEIRS[name].__name__
    proxy = types.SimpleNamespace(**vars(module.layers))
    setattr(proxy, original, OURS[name])
    monkeypatch.setattr(module, "layers", proxy)
    monkeypatch.setattr(keras.layers, original, OURS[name])  # tests that name keras.layers.X
    calls = []
    monkeypatch.setattr(OURS[name], "__init__", _spy(OURS[name].__init__, calls))
    result = unittest.TestResult()
    getattr(module, cls)(method).run(result)
    problems = [text for _, text in result.errors + result.failures]
    if (name, method) in DEVIATIONS:  # documented: the failure is exactly the expected one
        assert len(problems) == 1 and DEVIATIONS[name, method] in problems[0], problems
        return
    assert not problems, problems[0]
    assert calls, "the keras test did not construct our class"


def _spy(init, calls):
    def spied(self, *args, **kwargs):
        calls.append(type(self))
        init(self, *args, **kwargs)

    return spied


# ------------------------------------------------------------------ configuration and weights
CONFIGS = {
    "ln": [{}, {"axis": [1, 2], "epsilon": 1e-5, "center": False}, {"rms_scaling": True}],
    "gn": [{}, {"groups": 4, "axis": 1, "gamma_regularizer": "l2"}, {"groups": -1}],
}


@pytest.mark.parametrize("name", ["ln", "gn"])
def test_config_is_keras_config_and_round_trips(name):
    for kwargs in CONFIGS[name]:
        ours = OURS[name](name="norm", **kwargs).get_config()
        assert ours == THEIRS[name](name="norm", **kwargs).get_config()
        assert OURS[name].from_config(ours).get_config() == ours
        serialized = keras.saving.serialize_keras_object(OURS[name](**kwargs))
        assert serialized["registered_name"] == f"tf_stable_moments>{OURS[name].__qualname__}"
        assert type(keras.saving.deserialize_keras_object(serialized)) is OURS[name]


@pytest.mark.parametrize("name", ["ln", "gn"])
def test_weights_have_keras_names_shapes_and_order(name):
    kwargs = {"groups": 4} if name == "gn" else {"axis": [1, 2]}
    shape = (None, 3, 8)
    layers = [cls(**kwargs) for cls in (THEIRS[name], OURS[name])]
    for layer in layers:
        layer.build(shape)
    theirs, ours = ([(w.name, w.shape, w.trainable) for w in layer.weights] for layer in layers)
    expected = (3, 8) if name == "ln" else (8,)
    assert ours == theirs == [("gamma", expected, True), ("beta", expected, True)]


def _small_model(ln, gn, seed=None):
    model = keras.Sequential(
        [keras.Input((3, 8)), keras.layers.Dense(8), ln(), keras.layers.Dense(8), gn(groups=4)]
    )
    if seed is not None:
        rng = np.random.default_rng(seed)
        model.set_weights([rng.normal(size=w.shape).astype(np.float32) for w in model.weights])
    return model


LN, GN = THEIRS["ln"], THEIRS["gn"]


@pytest.mark.parametrize(
    "writer, reader, suffix",
    [
        ((LN, GN), (StableLayerNormalization, StableGroupNormalization), ".weights.h5"),
        ((LN, GN), (StableLayerNormalization, GN), ".weights.h5"),
        ((StableLayerNormalization, StableGroupNormalization), (LN, GN), ".weights.h5"),
        ((LN, GN), (StableLayerNormalization, StableGroupNormalization), ".h5"),
    ],
    ids=["keras_to_ours", "keras_to_partly_replaced", "ours_to_keras", "legacy_h5_keras_to_ours"],
)
def test_weight_file_loads_across_the_classes(tmp_path, writer, reader, suffix):
    written = _small_model(*writer, seed=22)
    path = tmp_path / f"model{suffix}"
    written.save_weights(path) if suffix == ".weights.h5" else written.save(path)
    read = _small_model(*reader)
    read.load_weights(path)
    for a, b in zip(read.get_weights(), written.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [type(layer) for layer in read.layers[1::2]] == list(reader)


def test_keras_file_loads_without_custom_objects(tmp_path):
    model = _small_model(StableLayerNormalization, StableGroupNormalization, seed=23)
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert [type(layer) for layer in loaded.layers[1::2]] == [
        StableLayerNormalization,
        StableGroupNormalization,
    ]
    x = _normal(np.random.default_rng(24), 1e3, (4, 3, 8))
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(model(x)))


# ------------------------------------------------------------------ identity and errors
@pytest.mark.parametrize("name", ["ln", "gn"])
def test_class_identity_is_visible(name):
    cls = OURS[name]
    layer = cls(name="norm")
    assert repr(layer) == f"<tf_stable_moments.{cls.__qualname__} name=norm, built=False>"
    assert cls.__name__ == THEIRS[name].__name__  # keras's weight-file key
    model = keras.Sequential([keras.Input((4, 8)), cls(**({"groups": 4} if name == "gn" else {}))])
    assert type(pickle.loads(pickle.dumps(model)).layers[0]) is cls
    assert getattr(tf_stable_moments, cls.__qualname__) is cls
    assert cls.__qualname__ in tf_stable_moments.__all__


@pytest.mark.parametrize("name", ["ln", "gn"])
def test_unsupported_backend_raises(monkeypatch, name):
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    cls = OURS[name]
    with pytest.raises(
        NotImplementedError, match=f"{cls.__qualname__} runs on .*active Keras backend is 'torch'"
    ):
        cls()


@pytest.mark.parametrize(
    "name, kwargs, error, match",
    [
        ("ln", {"axis": {"axis": -1}}, TypeError, "argument 'axis', but received: {'axis': -1}"),
        ("gn", {"groups": 0}, ValueError, "argument `groups`.*Received: groups=0"),
        ("gn", {"groups": 1.5}, ValueError, "argument `groups`.*Received: groups=1.5"),
    ],
)
def test_invalid_arguments(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        OURS[name](**kwargs)


# ------------------------------------------------------------------ StableNormalization
def _adapt_data(offset, rows=1001, seed=30):
    return _normal(np.random.default_rng(seed), offset, (rows, 3))


def _adapted(cls, data, batch_size):
    layer = cls()
    layer.adapt(
        data if batch_size is None else tf.data.Dataset.from_tensor_slices(data).batch(batch_size)
    )
    return layer


def _exact_statistics(data):
    """The oracle: the exact mean and variance per feature, rounded once to float32."""
    pairs = [exact_value(data[:, c], np.float32) for c in range(data.shape[1])]
    return tuple(np.array([p[i] for p in pairs], np.float32) for i in (0, 1))


def _normalized_reference(data, x):
    """(x - mean) / sqrt(var) in float64 with the exact statistics of the float32 data."""
    d = data.astype(np.float64)
    return (x.astype(np.float64) - d.mean(0)) / d.std(0)


@pytest.mark.parametrize("offset", [1e6, 1e7], ids=["offset_1e6", "offset_1e7"])
def test_adapt_is_exact_for_every_batching_and_keras_is_not(monkeypatch, offset):
    """Batches of 1, 7, 1000 and all at once (and 7 / 1000 with no joining of batches):
    the same bits, the oracle's; the output within 1e-5 of float64; keras's measured beside."""
    data = _adapt_data(offset)
    mean, var = _exact_statistics(data)
    ref = _normalized_reference(data, data)
    outputs = []
    for batch_size, chunk in ((1, None), (7, None), (1000, None), (None, None), (7, 1), (1000, 1)):
        if chunk is not None:
            monkeypatch.setattr(_normalization, "_CHUNK_ELEMENTS", chunk)
        layer = _adapted(StableNormalization, data, batch_size)
        monkeypatch.undo()
        np.testing.assert_array_equal(
            layer.adapt_mean.numpy().view(np.uint32), mean.view(np.uint32)
        )
        np.testing.assert_array_equal(
            layer.adapt_variance.numpy().view(np.uint32), var.view(np.uint32)
        )
        assert int(layer.count.numpy()) == len(data)
        y = np.asarray(layer(data))
        assert np.max(np.abs(y - ref)) < F32_TOL
        outputs.append(y.view(np.uint32))
    for y in outputs[1:]:
        np.testing.assert_array_equal(y, outputs[0])
    for batch_size in (7, None):
        theirs = _adapted(keras.layers.Normalization, data, batch_size)
        assert np.max(np.abs(np.asarray(theirs(data)) - ref)) > 1e-2


@pytest.mark.parametrize("mode", MODES)
def test_normalization_call_modes_invert_and_given_statistics(mode):
    data = _adapt_data(1e6)
    adapted, inverted = StableNormalization(), StableNormalization(invert=True)
    for layer in (adapted, inverted):
        layer.adapt(data)
    given = StableNormalization(mean=[1e6 + 0.3, -2.5e7, 7.0], variance=[4.0, 0.25, 1.0])

    def fn(x, z):
        return adapted(x), inverted(z), given(x)

    if mode != "eager":
        fn = tf.function(fn, jit_compile=mode == "jit_compile")
    ref = _normalized_reference(data, data)
    y, back, y_given = (
        np.asarray(t) for t in fn(tf.constant(data), tf.constant(ref.astype(np.float32)))
    )
    assert np.max(np.abs(y - ref)) < F32_TOL
    d = data.astype(np.float64)
    back_ref = ref.astype(np.float32).astype(np.float64) * d.std(0) + d.mean(0)
    assert np.max(np.abs(back - back_ref)) < 2 * np.spacing(np.float32(1e6))
    given_ref = (d - np.array([1e6 + 0.3, -2.5e7, 7.0])) / np.array([2.0, 0.5, 1.0])
    assert np.max(np.abs(y_given - given_ref) / np.maximum(1, np.abs(given_ref))) < F32_TOL


def test_normalization_weights_and_files_of_keras_layer(tmp_path):
    data = _adapt_data(1e3)
    theirs = keras.layers.Normalization()
    theirs.adapt(data)
    ours = StableNormalization()
    ours.build(data.shape)
    names = [(w.name, w.shape) for w in ours.weights]
    assert names[:3] == [(w.name, w.shape) for w in theirs.weights]
    assert names[3] == ("mean_correction", (3,))
    ours.set_weights(theirs.get_weights())  # keras's three weights
    np.testing.assert_array_equal(ours.adapt_mean.numpy(), theirs.adapt_mean.numpy())
    np.testing.assert_array_equal(ours.mean_correction.numpy(), np.zeros(3, np.float32))
    np.testing.assert_allclose(
        np.asarray(ours(data)), np.asarray(theirs(data)), rtol=1e-6, atol=1e-6
    )
    plain = StableNormalization(compensated_mean=False)
    plain.build(data.shape)
    assert [w.name for w in plain.weights] == [w.name for w in theirs.weights]

    def model(cls):
        return keras.Sequential([keras.Input((3,)), cls(), keras.layers.Dense(2)])

    written = model(keras.layers.Normalization)
    written.layers[0].adapt(data)
    written.save_weights(tmp_path / "norm.weights.h5")
    read = model(StableNormalization)
    read.load_weights(tmp_path / "norm.weights.h5")
    for w_read, w_written in zip(read.layers[0].weights[:3], written.layers[0].weights):
        np.testing.assert_array_equal(np.asarray(w_read), np.asarray(w_written))
    np.testing.assert_array_equal(np.asarray(read.layers[1].kernel), written.layers[1].kernel)
    # The same statistics; ours multiplies by 1 / scale where keras divides (an ulp apart):
    # bit for bit its float32 formula on the loaded weights.
    mean, var = (np.asarray(w) for w in written.layers[0].weights[:2])
    scale = np.maximum(np.sqrt(var), np.float32(keras.config.epsilon()))
    want = (data.astype(np.float32) - mean) * (np.float32(1) / scale)
    got = np.asarray(read.layers[0](data))
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))
    mine = model(StableNormalization)
    mine.layers[0].adapt(_adapt_data(1e6))
    mine.save(tmp_path / "norm.keras")
    loaded = keras.models.load_model(tmp_path / "norm.keras")
    assert type(loaded.layers[0]) is StableNormalization
    x = _adapt_data(1e6, rows=16, seed=31)
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(mine(x)))


def test_normalization_config_and_errors():
    config = StableNormalization(axis=(1, 2), invert=True, name="n").get_config()
    assert config == {
        **keras.layers.Normalization(axis=(1, 2), invert=True, name="n").get_config(),
        "compensated_mean": True,
    }
    assert StableNormalization.from_config(config).get_config() == config
    serialized = keras.saving.serialize_keras_object(StableNormalization(mean=1.0, variance=2.0))
    assert serialized["registered_name"] == "tf_stable_moments>StableNormalization"
    assert type(keras.saving.deserialize_keras_object(serialized)) is StableNormalization
    with pytest.raises(
        ValueError, match="compensated_mean must be a bool; received: compensated_mean=1"
    ):
        StableNormalization(compensated_mean=1)
    with pytest.raises(ValueError, match="both `mean` and `variance` must be set"):
        StableNormalization(mean=1.0)
