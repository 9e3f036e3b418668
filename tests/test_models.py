"""The package as users run it: the main job's stderr, the one-call swap, real models.

Subprocesses (the main job, the JAX backend) are started by module fixtures as
soon as a test that needs them is selected, so they run while the tests in this
process do.
"""

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


def test_stabilize_rejects_what_it_cannot_swap():
    import keras

    import tf_stable_moments

    class Subclassed(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.bn = keras.layers.BatchNormalization()

        def call(self, x):
            return self.bn(x)

    with pytest.raises(TypeError, match=r"model must be a keras.Model .*received model=.*Dense"):
        tf_stable_moments.stabilize(keras.layers.Dense(2))
    with pytest.raises(ValueError, match="model='subclassed' is a subclassed model of class"):
        tf_stable_moments.stabilize(Subclassed(name="subclassed"))
    inputs = keras.Input((3,))
    outer = keras.Model(inputs, Subclassed(name="inner")(inputs))
    with pytest.raises(ValueError, match="the nested model 'inner' is a subclassed model"):
        tf_stable_moments.stabilize(outer)
