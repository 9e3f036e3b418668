"""Regression tests for defects users reported, pinned against the desired behaviour.

(a) a second TF1-style graph must not get tensors of the first;
(b) tf.function(moments) must work after the eager context is reset (last in the file);
(c) a NaN in one slice must not reach the gradients of the other slices;
(d) complex NaN/Inf: each part of the mean follows its own part's special values;
(e) bad axes and ddof: TypeError/ValueError naming the value, in both frameworks;
(f) Keras fit with jit_compile=True and a partial last batch.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
import tensorflow as tf
from modes import run

import jax_kernel
import tf_stable_moments
from moments_core import _validate
from tf_stable_moments._oracle import exact_moments, exact_value, round_rational


def bits(a):
    """The bit patterns of a float or complex array (complex64: uint32 pairs)."""
    a = np.ascontiguousarray(np.asarray(a)).reshape(-1)
    part = a.real.dtype.itemsize if np.iscomplexobj(a) else a.dtype.itemsize
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[part])


def assert_same_bits(got, expected, what=""):
    np.testing.assert_array_equal(bits(got), bits(expected), err_msg=what)


def oracle(x, axis):
    """The exact rounded (mean, var) of every slice of a 2-D x along `axis`."""
    x = np.moveaxis(np.asarray(x), axis, -1)
    dtype = x.real.dtype.type
    means, variances = [], []
    for row in x:
        if np.iscomplexobj(row):
            mean = complex(exact_moments(row.real, dtype)[0], exact_moments(row.imag, dtype)[0])
            var = round_rational(
                exact_value(row.real, dtype)[1] + exact_value(row.imag, dtype)[1], dtype
            )
        else:
            mean, var = exact_moments(row, dtype)
        means.append(mean)
        variances.append(var)
    return np.array(means, x.dtype), np.array(variances, dtype)


def data(dtype, shape=(10, 300), seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(3.0, 1.0, shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.normal(-2.0, 0.5, shape)
    return x.astype(dtype)


# ------------------------------------------------ (a) TF1-style graphs, one after the other


@pytest.mark.parametrize("dtype", [np.float32, np.complex64], ids=["float32", "complex64"])
def test_a_second_tf1_graph_gets_no_tensors_of_the_first(dtype):
    x = data(dtype)
    outs = []
    for _ in range(2):
        with tf.Graph().as_default():
            mean, var = tf_stable_moments.moments(tf.constant(x), axes=[1])
            with tf.compat.v1.Session() as session:
                outs.append(session.run([mean, var]))
    # Eager last: no eager result is cached before the graphs are built.
    eager = [o.numpy() for o in tf_stable_moments.moments(tf.constant(x), axes=[1])]
    for name, e, o in zip(("mean", "var"), eager, oracle(x, 1)):
        assert_same_bits(e, o, f"eager {name} against the oracle")
    for i, out in enumerate(outs):
        for name, g, e in zip(("mean", "var"), out, eager):
            assert_same_bits(g, e, f"graph {i} {name} against eager")


def test_tf_nn_moments_still_works_in_a_graph_after_ours():
    x = data(np.float32)
    ref = [x.astype(np.float64).mean(1), x.astype(np.float64).var(1)]
    with tf.Graph().as_default():
        ours = tf_stable_moments.moments(tf.constant(x), axes=[1])
        with tf.compat.v1.Session() as session:
            ours = session.run(ours)
        theirs = tf.nn.moments(tf.constant(x), axes=[1])
        with tf.compat.v1.Session() as session:
            theirs = session.run(theirs)
    for name, o, t, r in zip(("mean", "var"), ours, theirs, ref):
        np.testing.assert_allclose(t, r, rtol=1e-5, err_msg=f"tf.nn.moments {name}")
        np.testing.assert_allclose(o, r, rtol=1e-6, err_msg=f"our {name}")


# ------------------------------------------------ (c) NaN in one slice, gradients of others


def _gradient(framework, x, output, j):
    """d moments(x, axis 1)[output][j] / dx."""
    if framework == "tf":
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = tf_stable_moments.moments(xt, axes=[1])[output][j]
        return tape.gradient(y, xt).numpy()
    if framework == "tf_nn":
        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = tf.nn.moments(xt, axes=[1])[output][j]
        return tape.gradient(y, xt).numpy()
    return np.asarray(jax.grad(lambda v: jax_kernel.moments(v, 1)[output][j])(jnp.asarray(x)))


@pytest.mark.parametrize("j", [1, 2], ids=["slice1", "slice2"])
@pytest.mark.parametrize("output", [0, 1], ids=["mean", "var"])
@pytest.mark.parametrize("framework", ["tf", "jax"])
def test_nan_in_one_slice_does_not_reach_the_gradients_of_others(framework, output, j):
    x = np.random.default_rng(4).normal(0.0, 1.0, (3, 8)).astype(np.float32)
    clean = x.copy()
    x[0, 3] = np.nan
    grad = _gradient(framework, x, output, j)
    assert np.all(np.isfinite(grad)), grad
    assert_same_bits(grad[0], np.zeros(8, np.float32), "row 0 (the NaN slice) must be exactly 0")
    # The other slices' gradients do not depend on row 0: tf.nn.moments on the clean data.
    ref = _gradient("tf_nn", clean, output, j)
    np.testing.assert_allclose(grad[1:], ref[1:], rtol=1e-5, atol=1e-6)


# ------------------------------------------------ (d) complex NaN/Inf, part by part

NAN, INF = float("nan"), float("inf")
COMPLEX_CASES = {
    "nan_real": ([complex(NAN, 0.5), 0.25j], (NAN, 0.375)),
    "inf_real": ([complex(INF, 0.5), 0.25j], (INF, 0.375)),
    "nan_imag": ([complex(0.5, NAN), 0.25], (0.375, NAN)),
}
COMPLEX_MODES = ["tf_eager", "tf_jit_compile", "tf_jit_compile_xla", "jax_jit"]


def _assert_part(got, expected, what):
    if np.isnan(expected):
        assert np.isnan(got), f"{what}: {got}, expected NaN"
    else:
        assert_same_bits(np.float32(got), np.float32(expected), what)


@pytest.mark.parametrize("mode", COMPLEX_MODES)
@pytest.mark.parametrize("case", list(COMPLEX_CASES))
def test_complex_special_values_stay_in_their_part(case, mode):
    values, (real, imag) = COMPLEX_CASES[case]
    mean, var = run(mode, np.array(values, np.complex64), (0,))
    assert mean.dtype == np.complex64 and var.dtype == np.float32
    _assert_part(mean.real, real, f"real part of the mean {mean}")
    _assert_part(mean.imag, imag, f"imaginary part of the mean {mean}")
    assert np.isnan(var), var


@pytest.mark.parametrize("case", list(COMPLEX_CASES))
def test_complex_special_values_have_the_same_bits_in_tf_and_jax(case):
    x = np.array(COMPLEX_CASES[case][0], np.complex64)
    results = {mode: run(mode, x, (0,)) for mode in COMPLEX_MODES}
    ref = results["jax_jit"]
    for mode, out in results.items():
        for name, o, r in zip(("mean", "var"), out, ref):
            assert_same_bits(o, r, f"{mode} {name} {o} against jax {r}")


# ------------------------------------------------ (e) bad axes and ddof

IMPLS = {
    "tf": lambda x, axes, ddof=0: tf_stable_moments.moments(x, axes, ddof=ddof),
    "jax": lambda x, axes, ddof=0: jax_kernel.moments(x, axes, ddof=ddof),
    "core": lambda x, axes, ddof=0: (
        _validate.canonical_axes(axes, x.ndim),
        _validate.check_ddof(ddof),
    ),
}
AXES_TYPE = r"moments: axes must be an int or a sequence of ints; got axes="
BAD_TYPE_AXES = {
    "float": 1.5,
    "float_in_list": [0.7],
    "string": "1",
    "string_in_list": ["1"],
    "bool": True,
    "bool_in_list": [True],
    "numpy_bool": np.bool_(True),
    "nested_list": [[0, 1]],
    "numpy_float": np.float32(1),
    "object": object(),
}
BAD_VALUE_AXES = {
    "out_of_range": ([2], r"moments: axis 2 is out of range for an input of rank 2"),
    "out_of_range_int": (3, r"moments: axis 3 is out of range for an input of rank 2"),
    "negative_out_of_range": ([-3], r"moments: axis -3 is out of range for an input of rank 2"),
    "repeated": ([0, 0], r"moments: axes contains a repeated axis; got axes=\(0, 0\)"),
    "repeated_negative": ([1, -1], r"moments: axes contains a repeated axis; got axes=\(1, -1\)"),
}
BAD_DDOF = {"negative": -1, "float": 1.5, "bool": True, "numpy_bool": np.bool_(False)}


@pytest.mark.parametrize("axes", BAD_TYPE_AXES.values(), ids=BAD_TYPE_AXES.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_axes_types_raise_type_error_naming_the_value(impl, axes):
    with pytest.raises(TypeError, match=AXES_TYPE + re.escape(repr(axes))):
        IMPLS[impl](np.zeros((2, 3), np.float32), axes)


@pytest.mark.parametrize("axes,pattern", BAD_VALUE_AXES.values(), ids=BAD_VALUE_AXES.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_axes_values_raise_value_error_naming_them(impl, axes, pattern):
    with pytest.raises(ValueError, match=pattern):
        IMPLS[impl](np.zeros((2, 3), np.float32), axes)


@pytest.mark.parametrize("ddof", BAD_DDOF.values(), ids=BAD_DDOF.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_bad_ddof_raises_value_error_naming_it(impl, ddof):
    pattern = r"moments: ddof must be a non-negative int; got ddof=" + re.escape(repr(ddof))
    with pytest.raises(ValueError, match=pattern):
        IMPLS[impl](np.zeros((2, 3), np.float32), [0], ddof=ddof)


# ------------------------------------------------ (f) Keras fit, partial last batch


@pytest.mark.parametrize("jit_compile", [True, False], ids=["jit_compile", "no_jit_compile"])
def test_fit_with_a_partial_last_batch(jit_compile):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(50, 8)).astype(np.float32), rng.normal(size=(50, 1)).astype(np.float32)
    xv, yv = (
        rng.normal(size=(10, 8)).astype(np.float32),
        rng.normal(size=(10, 1)).astype(np.float32),
    )
    model = keras.Sequential(
        [
            keras.Input([8]),
            keras.layers.Dense(16),
            tf_stable_moments.StableBatchNormalization(),
            tf_stable_moments.StableBatchNormalization(),
            keras.layers.Dense(1),
        ]
    )
    model.compile("sgd", "mse", jit_compile=jit_compile)
    assert model.jit_compile is jit_compile
    # 50 samples in batches of 16: the last batch has 2.
    history = model.fit(x, y, batch_size=16, epochs=1, validation_data=(xv, yv), verbose=0)
    assert np.isfinite(history.history["loss"]).all(), history.history
    assert np.isfinite(history.history["val_loss"]).all(), history.history


# ------------------------------------------------ (b) after the eager context is reset
# In a fresh interpreter, so that the reset disturbs no other test.  It starts when the
# module's first test runs and runs next to the tests above; the tests below wait for it.

_RESET_SCRIPT = textwrap.dedent(
    """
    import json
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.eager import context
    import tf_stable_moments

    x = np.random.default_rng(0).normal(3.0, 1.0, (10, 300)).astype(np.float32)

    def call(fn):
        try:
            return [o.numpy().view(np.uint32).tolist() for o in fn(tf.constant(x), axes=[1])]
        except Exception as err:  # reported to the test, not raised here
            return f"{type(err).__name__}: {err}"[:2000]

    out = {"before": call(tf.function(tf_stable_moments.moments))}
    context._reset_context()
    out["function_after"] = call(tf.function(tf_stable_moments.moments))
    out["eager_after"] = call(tf_stable_moments.moments)
    print("RESULT " + json.dumps(out))
    """
)
_RESET_TEST = "test_moments_after_eager_context_reset"


@pytest.fixture(scope="module", autouse=True)
def _reset_process(request):
    """The subprocess of the reset tests, started early if any of them is selected."""
    if not any(item.name.startswith(_RESET_TEST) for item in request.session.items):
        yield None
        return
    root = os.path.dirname(os.path.dirname(os.path.abspath(tf_stable_moments.__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    # Files, not pipes: a full pipe would block the child while the tests above run.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", _RESET_SCRIPT], stdout=out, stderr=err, env=env
        )
        proc.output = (out, err)
        yield proc
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _read(file):
    file.seek(0)
    return file.read()


@pytest.fixture(scope="module")
def after_reset(_reset_process):
    """The bits before and after context._reset_context(), from the subprocess."""
    try:
        _reset_process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        _reset_process.kill()
        _reset_process.wait()
    stdout, stderr = (_read(f) for f in _reset_process.output)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert _reset_process.returncode == 0 and lines, stdout[-3000:] + stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert isinstance(out["before"], list), out["before"]
    return out


@pytest.mark.parametrize("call", ["function_after", "eager_after"])
def test_moments_after_eager_context_reset(after_reset, call):
    got = after_reset[call]
    assert isinstance(got, list), f"{call} raised: {got}"
    assert got == after_reset["before"]
