"""The kernel is chosen by the device of the data, in one place per framework.

The native kernels run on the CPU only.  A GPU or TPU tensor must never reach them:
TensorFlow would place the CPU op on the host and copy the activations there and back
(`tf_stable_moments._native.serves`); JAX lowers the native FFI call for the CPU
platform only (`jax_kernel._moments._stats_p`).  No accelerator is needed to check
this: TensorFlow graphs keep the device a scope asks for, and JAX lowers for any
platform on request.  The kernels chosen for a device give the bits of the CPU's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from modes import bits

import jax_kernel
import tf_stable_moments
from jax_kernel import _moments as jax_moments
from jax_kernel import _native as jax_native
from tf_stable_moments import _native as tf_native

NATIVE_TF = tf_native.op() is not None
NATIVE_JAX = jax_native.available()


def data(shape=(64, 8), offset=1e4, seed=0):
    return np.random.default_rng(seed).normal(offset, 1.0, shape).astype(np.float32)


def native_ops(concrete):
    return sorted({o.type for o in concrete.graph.get_operations() if o.type.startswith("Stable")})


class FakeTensor:
    def __init__(self, device):
        self.device = device


@pytest.mark.parametrize(
    "device,expected",
    [
        ("/job:localhost/replica:0/task:0/device:CPU:0", NATIVE_TF),
        ("/job:localhost/replica:0/task:0/device:GPU:0", False),
        ("/job:worker/replica:0/task:1/device:TPU:3", False),
    ],
    ids=["cpu", "gpu", "tpu"],
)
def test_tf_native_ops_serve_cpu_tensors_only(device, expected):
    assert tf_native.serves(FakeTensor(device)) is expected


@pytest.mark.parametrize("scope", ["/GPU:0", "/device:TPU:0"])
def test_tf_graph_on_a_device_holds_no_native_op_and_gives_the_cpu_bits(scope):
    x = data()

    @tf.function
    def on_device(v):
        with tf.device(scope):
            return tf_stable_moments.moments(v, [0])

    assert native_ops(on_device.get_concrete_function(tf.TensorSpec(x.shape, tf.float32))) == []
    tf.config.set_soft_device_placement(True)  # no accelerator here: it runs on the CPU
    got = on_device(tf.constant(x))
    want = tf_stable_moments.moments(tf.constant(x), [0])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g.numpy()), bits(w.numpy()))


def test_tf_graph_with_an_accelerator_visible_and_no_scope_holds_no_native_op(monkeypatch):
    """No device scope: TensorFlow's placer would put the model on the accelerator and
    the CPU-only op on the host, so the XLA kernel is traced (also for the layers)."""
    spec = tf.TensorSpec((64, 8), tf.float32)
    layer = tf_stable_moments.StableBatchNormalization()
    layer.build((64, 8))
    graphs = {}
    for visible in (False, True):
        monkeypatch.setattr(tf_native, "_accelerator_visible", lambda v=visible: v)
        moments = tf.function(lambda v: tf_stable_moments.moments(v, [0]))
        step = tf.function(lambda v: layer(v, training=True))
        graphs[visible] = native_ops(moments.get_concrete_function(spec)) + native_ops(
            step.get_concrete_function(spec)
        )
    assert graphs[True] == []
    native = [
        "StableMoments",
        "StableBlend",
        "StableCentre",
        "StableScaleShift",
        "StableStallCheck",
    ]
    assert graphs[False] == (native if NATIVE_TF else [])


def test_tf_cpu_scope_keeps_the_native_op_with_an_accelerator_visible(monkeypatch):
    monkeypatch.setattr(tf_native, "_accelerator_visible", lambda: True)

    @tf.function
    def on_cpu(v):
        with tf.device("/CPU:0"):
            return tf_stable_moments.moments(v, [0])

    concrete = on_cpu.get_concrete_function(tf.TensorSpec((64, 8), tf.float32))
    assert native_ops(concrete) == (["StableMoments"] if NATIVE_TF else [])


@pytest.mark.parametrize("platforms", [("cuda",), ("tpu",), ("rocm",)], ids=lambda p: p[0])
def test_jax_lowering_for_a_device_holds_no_native_call(platforms):
    x = jnp.asarray(data())

    def f(v):
        return jax_kernel.moments(v, (0,)), jax_moments.stats(v, (0,), 0, True)

    text = jax.jit(f).trace(x).lower(lowering_platforms=platforms).as_text()
    assert jax_native.TARGET not in text and jax_native.LO_TARGET not in text
    cpu = jax.jit(f).trace(x).lower(lowering_platforms=("cpu",)).as_text()
    assert (jax_native.TARGET in cpu) is (NATIVE_JAX and jax_moments._use_native())


def test_jax_one_export_for_cpu_and_gpu_chooses_per_platform():
    """Lowered for several platforms at once: the CPU branch holds the native call, the
    others the XLA kernel; run here (CPU), the bits are those of the XLA kernel."""
    x = jnp.asarray(data())
    f = jax.jit(lambda v: jax_kernel.moments(v, (0,)))
    text = f.trace(x).lower(lowering_platforms=("cpu", "cuda")).as_text()
    assert (jax_native.TARGET in text) is (NATIVE_JAX and jax_moments._use_native())
    got = f(x)
    want = jax_moments.stats(x, (0,), 0, False, native=False)
    np.testing.assert_array_equal(bits(np.asarray(got[0])), bits(np.asarray(want[0])))
    np.testing.assert_array_equal(bits(np.asarray(got[1])), bits(np.asarray(want[2])))


@pytest.mark.parametrize("platforms", [("cuda",), ("tpu",)], ids=lambda p: p[0])
@pytest.mark.native
def test_jax_stall_check_lowered_for_a_device_holds_no_native_call(platforms):
    """The layers' stall check (one FFI call on the CPU) passes the moving mean through
    in a computation lowered for a device: no host call there."""
    vectors = [jnp.full((4,), v, jnp.float32) for v in (1e6, 1e6 + 1, 1.0)]

    def check(*v):
        return jax_native.stall_call(*v, 0.9, 1e-3, 10.0, 0)

    device = jax.jit(check).trace(*vectors).lower(lowering_platforms=platforms).as_text()
    assert "stablehlo.custom_call" not in device
    cpu = jax.jit(check).trace(*vectors).lower(lowering_platforms=("cpu",)).as_text()
    assert f"@{jax_native.STALL_TARGET}" in cpu
    np.testing.assert_array_equal(bits(np.asarray(jax.jit(check)(*vectors))), bits(vectors[0]))
    # Concrete arrays (eager and under disable_jit: the primitive's impl) and vmap.
    np.testing.assert_array_equal(bits(np.asarray(check(*vectors))), bits(vectors[0]))
    with jax.disable_jit():
        np.testing.assert_array_equal(bits(np.asarray(check(*vectors))), bits(vectors[0]))
    stacked = jnp.stack([vectors[0], vectors[0] + 64])
    out = jax.vmap(lambda m: check(m, *vectors[1:]))(stacked)
    np.testing.assert_array_equal(bits(np.asarray(out)), bits(np.asarray(stacked)))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_jax_stall_check_without_the_native_library_is_chosen_per_platform(monkeypatch, platform):
    """Without the native library the JAX layers check on the CPU with a host callback,
    chosen per lowering platform (not by jax.default_backend()): none on a device."""
    from tf_stable_moments import _advice

    monkeypatch.setattr(jax_native, "available", lambda: False)

    class Layer:
        name, momentum, epsilon = "bn", 0.999, 1e-3

    # Channel 0 stalls: the batch mean is 20 std away, the update below half an ulp.
    values = [jnp.asarray(v, jnp.float32) for v in ([1e6, 0.0], [1e6 + 20.0, 0.0], [1.0, 1.0])]

    def check(*v):
        return _advice._check_jax(Layer(), *v)

    device = jax.jit(check).trace(*values).lower(lowering_platforms=(platform,)).as_text()
    assert "callback" not in device
    cpu = jax.jit(check).trace(*values).lower(lowering_platforms=("cpu",)).as_text()
    assert "callback" in cpu
    with pytest.warns(UserWarning, match=r"StableBatchNormalization 'bn': .*\(channel 0:"):
        out = jax.block_until_ready(jax.jit(check)(*values))
        jax.effects_barrier()
    np.testing.assert_array_equal(bits(np.asarray(out)), bits(np.asarray(values[0])))
