"""Analytic gradients: against float64 finite differences, tf.nn.moments, second order."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

import jax_kernel
import tf_stable_moments


def float64_reference(x, weights_mean, weights_var, ddof=0):
    """Gradient of sum(wm * mean) + sum(wv * var) over axis 0, analytic in float64."""
    x = x.astype(np.float64)
    n = x.shape[0]
    r = x - x.mean(axis=0)
    return weights_mean / n + weights_var * 2 * r / (n - ddof)


def finite_difference(x, weights_mean, weights_var, ddof=0, h=1e-6):
    x = x.astype(np.float64)

    def loss(v):
        return np.sum(weights_mean * v.mean(0)) + np.sum(weights_var * v.var(0, ddof=ddof))

    grad = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        grad[idx] = (loss(x + e) - loss(x - e)) / (2 * h)
    return grad


@pytest.mark.parametrize("offset", [0.0, 1e6], ids=["benign", "offset_1e6"])
@pytest.mark.parametrize("ddof", [0, 1])
def test_tf_gradient_matches_float64(offset, ddof):
    rng = np.random.default_rng(0)
    x = (offset + rng.normal(0, 1, (16, 3))).astype(np.float32)
    wm, wv = rng.normal(size=3), rng.normal(size=3)
    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        mean, var = tf_stable_moments.moments(xt, [0], ddof=ddof)
        loss = tf.reduce_sum(wm.astype(np.float32) * mean) + tf.reduce_sum(
            wv.astype(np.float32) * var
        )
    grad = tape.gradient(loss, xt).numpy()
    expected = float64_reference(x, wm, wv, ddof)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)
    if offset == 0.0:  # finite differences in float64 agree where the data are benign
        np.testing.assert_allclose(grad, finite_difference(x, wm, wv, ddof), rtol=1e-4, atol=1e-5)


def test_tf_gradient_agrees_with_tf_nn_moments_on_benign_data():
    x = tf.constant(np.random.default_rng(1).normal(0, 1, (8, 5, 4)).astype(np.float32))
    grads = []
    for fn in (tf.nn.moments, tf_stable_moments.moments):
        with tf.GradientTape() as tape:
            tape.watch(x)
            mean, var = fn(x, [0, 1])
            loss = tf.reduce_sum(mean * 3.0) + tf.reduce_sum(var * var)
        grads.append(tape.gradient(loss, x).numpy())
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["graph", "jit_compile"])
def test_tf_gradient_in_graph_modes(mode):
    x = np.random.default_rng(2).normal(1e5, 1, (12, 2)).astype(np.float32)

    @tf.function(jit_compile=mode == "jit_compile")
    def grad(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            loss = tf.reduce_sum(tf_stable_moments.moments(v, [0])[1])
        return tape.gradient(loss, v)

    expected = float64_reference(x, np.zeros(2), np.ones(2))
    np.testing.assert_allclose(grad(tf.constant(x)).numpy(), expected, rtol=1e-5, atol=1e-5)


def test_tf_second_order_with_nested_tapes():
    rng = np.random.default_rng(3)
    x = tf.constant((1e4 + rng.normal(0, 1, (6,))).astype(np.float32))
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            var = tf_stable_moments.moments(x, [0])[1]
        g = inner.gradient(var, x)
    hessian = outer.jacobian(g, x).numpy()
    n = 6
    expected = 2.0 / n * (np.eye(n) - 1.0 / n)  # d2 var / dx2 for the population variance
    np.testing.assert_allclose(hessian, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("offset", [0.0, 1e6], ids=["benign", "offset_1e6"])
def test_jax_grad_jvp_and_hessian(offset):
    rng = np.random.default_rng(4)
    x = (offset + rng.normal(0, 1, (10,))).astype(np.float32)
    n = x.size

    def var(v):
        return jax_kernel.moments(v, 0)[1]

    grad = np.asarray(jax.grad(var)(jnp.asarray(x)))
    np.testing.assert_allclose(
        grad, float64_reference(x[:, None], 0.0, 1.0)[:, 0], rtol=1e-5, atol=1e-6
    )
    _, tangent = jax.jvp(
        lambda v: jax_kernel.moments(v, 0)[0], (jnp.asarray(x),), (jnp.ones(n, jnp.float32),)
    )
    assert float(tangent) == pytest.approx(1.0)
    hessian = np.asarray(jax.hessian(var)(jnp.asarray(x)))
    np.testing.assert_allclose(hessian, 2.0 / n * (np.eye(n) - 1.0 / n), rtol=1e-5, atol=1e-6)
    jitted = np.asarray(jax.jit(jax.grad(var))(jnp.asarray(x)))
    np.testing.assert_allclose(jitted, grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("native", [True, False], ids=["native", "xla"])
def test_complex_moments_under_a_recording_tape_have_no_gradient_in_every_kernel(native):
    """Complex input is not differentiable (the native op's gradient gives None).  With
    the native kernel off, a recording tape used to trace the XLA kernel's gradient and
    fail (no gradient for XlaVariadicReduceV2); both kernels now give the bits and None."""
    from modes import bits
    from modes import native as native_switch

    x = tf.constant(np.array([[1e6 + 0.5j, 1e6 + 0.25j], [3 - 1j, 2 + 0j]], np.complex64))
    with native_switch(native), tf.GradientTape() as tape:
        tape.watch(x)
        mean, var = tf_stable_moments.moments(x, [1])
    assert tape.gradient(var, x) is None
    want = tf_stable_moments.moments(x, [1])  # no tape
    np.testing.assert_array_equal(bits(mean.numpy()), bits(want[0].numpy()))
    np.testing.assert_array_equal(bits(var.numpy()), bits(want[1].numpy()))
