"""Exported artifacts hold only standard operations and load where this package is not
installed (issue #26): `jax.export` (one platform, several, a symbolic batch),
`tf.saved_model.save`, Keras `model.export` under `tf_stable_moments.portable`, and
TensorFlow Lite flatbuffers converted under `portable("tflite")`.

Each artifact is loaded and served by tests/_deploy_load.py in a fresh process in which
importing the package fails; its outputs must have the bits of the live computation
(the statistics are certified: every kernel gives the oracle's bits).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
LOADER = ROOT / "tests" / "_deploy_load.py"


def _python(args, cwd, **env):
    """Run a Python script in a fresh process (env: variables set, or removed with None)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **env}
    env = {k: v for k, v in env.items() if v is not None}
    proc = subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _serve(kind, artifact, x, tmp_path):
    """Outputs of the artifact, served by a process without the package."""
    source, target = tmp_path / "x.npy", tmp_path / "out.npz"
    np.save(source, x)
    _python([LOADER, kind, artifact, source, target], tmp_path, PYTHONPATH=None)
    with np.load(target) as out:
        return [out[f"out_{i}"] for i in range(len(out.files))]


def _bits(a):
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _data(shape=(64, 8), dtype=np.float32):
    rng = np.random.default_rng(26)
    x = rng.normal(1e4, 1.0, shape).astype(dtype)
    x[:, 1] = rng.normal(0.0, 1e-3, shape[0]).astype(dtype)
    x[:, 2] = 7.0  # a constant slice
    return x


def _native_on():
    """The live kernel is the native one unless TF_STABLE_MOMENTS_NATIVE=0: the live
    graphs below hold our ops exactly then (and none of ours on the fallback)."""
    from moments_core.native import enabled

    return enabled()


def _assert_oracle(x, mean, var):
    from tf_stable_moments._oracle import exact_moments

    for j in range(x.shape[1]):
        m, v = exact_moments(x[:, j], x.dtype)
        assert _bits(mean[j]) == _bits(np.asarray(m, x.dtype))
        assert _bits(var[j]) == _bits(np.asarray(v, x.dtype))


@pytest.mark.parametrize(
    "platforms, batch",
    [(("cpu",), "64"), (("cpu", "cuda", "tpu"), "64"), (("cpu",), "b")],
    ids=["cpu", "cpu_cuda_tpu", "cpu_symbolic_batch"],
)
def test_jax_export_holds_no_custom_call_and_serves_without_the_package(platforms, batch, tmp_path):
    import jax
    import jax.numpy as jnp
    from jax import export

    import jax_kernel

    x = _data()
    spec = jax.ShapeDtypeStruct(export.symbolic_shape(f"{batch}, 8"), jnp.float32)
    fn = jax.jit(lambda v: jax_kernel.moments(v, (0,)))
    exported = export.export(fn, platforms=platforms)(spec)
    text = exported.mlir_module()
    assert "custom_call @tf_stable_moments" not in text
    live_native = "custom_call @tf_stable_moments" in fn.lower(x).as_text()
    assert live_native == _native_on()  # live: the native call, if not switched off
    artifact = tmp_path / "moments.jax"
    artifact.write_bytes(exported.serialize())
    mean, var = _serve("jax", artifact, x, tmp_path)
    live = fn(x)
    np.testing.assert_array_equal(_bits(mean), _bits(live[0]))
    np.testing.assert_array_equal(_bits(var), _bits(live[1]))
    _assert_oracle(x, mean, var)


def _stable_ops(path):
    """Op types of a SavedModel's graphs (functions included) that this package defines."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((Path(path) / "saved_model.pb").read_bytes())
    found = set()
    for meta in proto.meta_graphs:
        nodes = list(meta.graph_def.node)
        for fn in meta.graph_def.library.function:
            nodes += list(fn.node_def)
        for node in nodes:
            if node.op.startswith("Stable") or node.op == "XlaCustomCallV2":
                found.add(node.op)
    return found


def _xla_functions(path):
    """Names of a SavedModel's functions that XLA compiles when called (per shape)."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((Path(path) / "saved_model.pb").read_bytes())
    return {
        fn.signature.name
        for meta in proto.meta_graphs
        for fn in meta.graph_def.library.function
        if "_XlaMustCompile" in fn.attr and fn.attr["_XlaMustCompile"].b
    }


def test_tf_saved_model_save_is_portable_and_serves_without_the_package(tmp_path):
    import tensorflow as tf

    import tf_stable_moments as tsm

    x = _data()

    class Stats(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
        def f(self, v):
            return tsm.moments(v, [0])

    path = tmp_path / "saved"
    tf.saved_model.save(Stats(), str(path))
    assert not _stable_ops(path)
    mean, var = _serve("savedmodel", path, x, tmp_path)
    live = tsm.moments(tf.constant(x), [0])  # eager: the native kernel
    np.testing.assert_array_equal(_bits(mean), _bits(live[0].numpy()))
    np.testing.assert_array_equal(_bits(var), _bits(live[1].numpy()))
    _assert_oracle(x, mean, var)


def test_keras_model_export_is_portable_and_serves_without_the_package(tmp_path):
    import keras
    import tensorflow as tf

    import tf_stable_moments as tsm

    x = _data((32, 8))
    inputs = keras.Input((8,))
    h = keras.layers.Dense(8)(inputs)
    h = tsm.StableBatchNormalization()(h)
    outputs = tsm.StableLayerNormalization()(h)
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    model.fit(x, x, epochs=1, verbose=0)  # traced and run with the native ops
    path = tmp_path / "exported"
    model.export(str(path), verbose=False)
    live = model(tf.constant(x), training=False).numpy()  # eager: the native ops
    assert not _stable_ops(path)
    (out,) = _serve("savedmodel", path, x, tmp_path)
    # Certified statistics and output formulas with every rounding fixed (docs section
    # 14): the loaded graph serves the live model's bits.
    np.testing.assert_array_equal(_bits(out), _bits(live))
    # The output formulas are a plain function, not an XLA computation that the served
    # artifact would compile per shape: BatchNormalization at inference has none.
    bn_only = keras.Model(inputs, model.layers[2](model.layers[1](inputs)))
    bn_path = tmp_path / "bn_only"
    bn_only.export(str(bn_path), verbose=False)
    assert not _xla_functions(bn_path)
    special = x.copy()  # rows of NaN, of +-inf and NaN (inf - inf), of overflow
    special[0, 0], special[1, 3], special[2, 5], special[3] = np.nan, np.inf, -np.inf, 3e38
    for data in (x, special):
        (out,) = _serve("savedmodel", bn_path, data, tmp_path)
        np.testing.assert_array_equal(_bits(out), _bits(bn_only(tf.constant(data)).numpy()))
    # On request, the native ops (an artifact for where the package is installed).
    native = tmp_path / "native"
    with tsm.portable(False):
        model.export(str(native), verbose=False)
    want = {"StableCentre", "StableScaleShift"}  # inference: no moving averages to blend
    assert _stable_ops(native) == (want if _native_on() else set())


def test_keras_jax_model_export_serves_without_the_package(tmp_path):
    """jax2tf: the artifact is an XlaCallModule of the exported StableHLO (no custom call
    of ours: `jax.export` lowers the XLA kernel), read by TensorFlow's own StableHLO."""
    x = _data((32, 8))
    source, artifact, live = tmp_path / "in.npy", tmp_path / "exported", tmp_path / "live.npy"
    np.save(source, x)
    path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    script = ROOT / "tests" / "_deploy_keras_jax.py"
    _python([script, source, artifact, live], ROOT, KERAS_BACKEND="jax", PYTHONPATH=path)
    (out,) = _serve("savedmodel", artifact, x, tmp_path)
    # As for the TF export: certified statistics and fixed roundings, evaluated by
    # TensorFlow's StableHLO instead of JAX: the same bits.
    np.testing.assert_array_equal(_bits(out), _bits(np.load(live)))


def test_portable_block_traces_standard_operations_and_rejects_a_non_bool():
    import tensorflow as tf

    import tf_stable_moments as tsm

    f = tf.function(lambda v: tsm.moments(v, [0]))
    spec = tf.TensorSpec([16, 3], tf.float32)

    def types(graph):
        return {op.type for op in graph.get_operations() if op.type.startswith("Stable")}

    ours = {"StableMoments"} if _native_on() else set()
    assert types(f.get_concrete_function(spec).graph) == ours
    g = tf.function(lambda v: tsm.moments(v, [0]))
    with tsm.portable():
        assert not types(g.get_concrete_function(spec).graph)
        h = tf.function(lambda v: tsm.moments(v, [0]))
        with tsm.portable(False):  # the innermost block decides
            assert types(h.get_concrete_function(spec).graph) == ours
    with pytest.raises(TypeError, match=r"portable: enabled must be a bool or 'tflite'; got 'yes'"):
        with tsm.portable("yes"):
            pass


def _normalized_reference(model, x):
    """The float64 forward pass of `_tflite_model`'s layers with its weights."""
    y = x.astype(np.float64)
    for layer in model.layers[1:]:
        w = [np.asarray(v, np.float64) for v in layer.get_weights()]
        kind = type(layer).__mro__[1].__name__ if "Stable" in type(layer).__name__ else ""
        kind = kind or type(layer).__name__
        if kind == "Dense":
            y = y @ w[0] + w[1]
            continue
        if kind == "BatchNormalization":  # inference: the moving statistics
            mean, var = w[2], w[3]
        elif kind == "LayerNormalization":
            mean, var = y.mean(-1, keepdims=True), y.var(-1, keepdims=True)
        else:  # GroupNormalization
            g = y.reshape(len(y), layer.groups, -1)
            mean = np.repeat(g.mean(-1), g.shape[-1], -1)
            var = np.repeat(g.var(-1), g.shape[-1], -1)
        y = (y - mean) / np.sqrt(var + layer.epsilon) * w[0] + w[1]
    return y


def _tflite_model(stable):
    """LayerNormalization on raw features at an offset, Dense, BatchNormalization, then
    GroupNormalization: ours (stable) or keras's."""
    import keras

    import tf_stable_moments as tsm

    layers = (
        (tsm.StableLayerNormalization, tsm.StableBatchNormalization, tsm.StableGroupNormalization)
        if stable
        else (
            keras.layers.LayerNormalization,
            keras.layers.BatchNormalization,
            keras.layers.GroupNormalization,
        )
    )
    inputs = keras.Input((16,))
    h = layers[0]()(inputs)
    h = keras.layers.Dense(32)(h)
    h = layers[1]()(h)
    outputs = layers[2](groups=4)(h)
    return keras.Model(inputs, outputs)


def test_tflite_conversion_under_portable_tflite_serves_without_the_package(tmp_path):
    """portable("tflite"): TFLiteConverter.from_keras_model, and from_saved_model of a
    `model.export` made in the block, and from_keras_model without the block (the
    converter traces the model: the layers see it), give flatbuffers of TFLite builtins
    (float32) that the TFLite interpreter serves in a process without the package: within 1e-5
    (relative to the largest output) of the live model, and far more accurate than the
    same model with keras's layers, converted as usual, on N(1e6, 1) features."""
    import tensorflow as tf

    import tf_stable_moments as tsm

    rng = np.random.default_rng(27)
    x = (1e6 + rng.normal(size=(64, 16))).astype(np.float32)
    model, keras_model = _tflite_model(True), _tflite_model(False)
    for _ in range(3):  # moving statistics away from their initial values
        model(rng.normal(1e6, 1.0, (64, 16)).astype(np.float32), training=True)
    for ours, theirs in zip(model.layers, keras_model.layers, strict=True):
        theirs.set_weights(ours.get_weights())
    live = model(tf.constant(x), training=False).numpy()
    want = _normalized_reference(model, x)
    scale = np.abs(want).max()

    path = tmp_path / "exported"
    converter = tf.lite.TFLiteConverter
    with tsm.portable("tflite"):
        flatbuffers = {"from_keras_model": converter.from_keras_model(model).convert()}
        model.export(str(path), verbose=False)
    flatbuffers["from_saved_model"] = converter.from_saved_model(str(path)).convert()
    # No block: the converter traces the model itself, and the layers see it doing so.
    flatbuffers["as_usual"] = converter.from_keras_model(model).convert()
    flatbuffers["keras"] = converter.from_keras_model(keras_model).convert()
    errors = {}
    for name, flatbuffer in flatbuffers.items():
        artifact = tmp_path / f"{name}.tflite"
        artifact.write_bytes(flatbuffer)
        (out,) = _serve("tflite", artifact, x, tmp_path)
        if name != "keras":
            assert np.abs(out - live).max() <= 1e-5 * np.abs(live).max(), name
        errors[name] = np.abs(out - want).max() / scale
    ours = [errors[k] for k in ("from_keras_model", "from_saved_model", "as_usual")]
    assert max(ours) <= 1e-5, errors
    assert errors["keras"] >= 100 * max(ours), errors
