"""The native CPU kernel (XLA FFI call, jax_kernel/_native) against the exact oracle and
the XLA kernel, bit for bit: layouts, dtypes, ddof, special values, jit, vmap, grad, eager,
and the fallback switch TF_STABLE_MOMENTS_NATIVE=0.

Every case is compared with the oracle (the contract both kernels meet).  The XLA kernel
takes about 8 s to compile per shape and dtype on a small CPU, so it is compared on a
few representative cases only; TF_STABLE_MOMENTS_NATIVE_FULL=1 compares it on all.
"""

import os
import warnings

import datasets
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from datasets import oracle

import jax_kernel
from jax_kernel import _moments, _native

pytestmark = pytest.mark.native  # tests of the native kernel (see tests/conftest.py)

BF16 = np.dtype(ml_dtypes.bfloat16)
FULL = os.environ.get("TF_STABLE_MOMENTS_NATIVE_FULL") == "1"


def bits(a):
    """The bit patterns of a (complex: both parts interleaved), flat."""
    a = np.ascontiguousarray(np.asarray(a)).reshape(-1)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}[a.dtype.itemsize])


def assert_same_bits(got, want):
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, w.dtype, g.shape, w.shape)
        np.testing.assert_array_equal(bits(g), bits(w))


def kernel(x, axes, ddof=0, native=True, keepdims=False):
    """jax_kernel's jitted moments with the kernel chosen: native or XLA."""
    out = _moments._moments(jnp.asarray(x), axes, keepdims, ddof, False, native)
    return tuple(np.asarray(o) for o in out)


def data(shape, dtype, offset=1e3, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(offset, scale, shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.normal(-offset, scale, shape)
    return x.astype(dtype)


# Layouts: rows, columns, a middle axis, adjacent axes, non-adjacent axes, all axes.
LAYOUTS = [
    ((6, 40), (1,)),
    ((40, 6), (0,)),
    ((3, 17, 4), (1,)),
    ((3, 5, 4, 2), (1, 2)),
    ((5, 3, 7), (0, 2)),
    ((4, 9), (0, 1)),
]


@pytest.mark.parametrize("shape,axes", LAYOUTS, ids=lambda v: str(v).replace(" ", ""))
def test_layouts_match_oracle_and_xla_bitwise(shape, axes):
    x = data(shape, np.float32, offset=1e6)
    x[(0,) * x.ndim] = 1e6 + 0.5  # a first element away from the mean
    got = kernel(x, axes)
    assert_same_bits(got, oracle(x, axes))
    if FULL:
        assert_same_bits(got, kernel(x, axes, native=False))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64", "complex64"])
@pytest.mark.parametrize("ddof", [0, 1])
def test_dtypes_and_ddof_match_oracle(dtype, ddof):
    dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    x = data((7, 12), dtype, offset=3.0 if dtype.itemsize == 2 else 1e6, scale=0.25)
    with jax.enable_x64(dtype == np.float64):
        got = kernel(x, (1,), ddof)
        assert_same_bits(got, oracle(x, (1,), ddof))
        if FULL:
            assert_same_bits(got, kernel(x, (1,), ddof, native=False))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_special_values_and_exact_path(dtype):
    """NaN, +Inf, both infinities in some slices; exact ties (the exact path) in others."""
    x = data((6, 8), dtype)
    x[:, 0] = np.nan if np.dtype(dtype).kind == "f" else np.nan + 1j
    x[2, 1], x[3, 2], x[4, 2] = np.inf, np.inf, -np.inf
    x[:, 3] = 1.0  # constant
    tie = np.asarray([1.0, 1.0 + np.finfo(np.float32).eps] * 3, dtype)  # mean: a midpoint
    x[:, 4] = tie if np.dtype(dtype) != np.float64 else tie + 2.0**-52
    x[:, 5] = 0.0
    with jax.enable_x64(np.dtype(dtype) == np.float64):
        got = kernel(x, (0,), 1)
        assert_same_bits(got, oracle(x, (0,), 1))
        if FULL or dtype == np.float32:
            assert_same_bits(got, kernel(x, (0,), 1, native=False))
        _, _, _, undecided = _moments.stats(jnp.asarray(x), (0,), 1, False, False, True, True)
    # The three NaN/Inf slices take the exact path; the tie too where the lattice rule (one
    # real part with float64 sums: float32 here) does not decide it
    if dtype == np.float32:
        assert int(undecided) == 3
    else:
        assert int(undecided) >= 4


def test_empty_and_degenerate_shapes():
    nan = np.nan
    cases = [  # x, axes, ddof, expected (mean, var)
        (np.ones((0, 3)), (0,), 0, ([nan] * 3, [nan] * 3)),  # no data: NaN
        (np.ones((3, 0)), (0,), 0, ([], [])),  # no slices
        (np.array([[1.0], [2.0]] * 2), (0,), 0, ([1.5], [0.25])),
        (np.full((2, 2), 1.5), (), 0, (np.full((2, 2), 1.5), np.zeros((2, 2)))),  # n = 1
        (np.full((3,), 1.5), (0,), 3, (1.5, nan)),  # n - ddof <= 0: NaN variance
    ]
    for x, axes, ddof, (mean, var) in cases:
        want = (np.asarray(mean, np.float32), np.asarray(var, np.float32))
        assert_same_bits(kernel(x.astype(np.float32), axes, ddof), want)


def test_keepdims_and_public_api_use_native():
    x = data((4, 6, 5), np.float32, offset=1e6)
    assert _moments._use_native()
    got = jax_kernel.moments(x, (0, 2), keepdims=True, ddof=1)
    assert got[0].shape == (1, 6, 1)
    assert_same_bits(got, [o.reshape(1, 6, 1) for o in oracle(x, (0, 2), 1)])


def test_jit_vmap_and_eager():
    x = data((3, 20, 4), np.float32, offset=1e6)
    want = [np.stack(o) for o in zip(*(oracle(s, (0,)) for s in x))]
    f = jax.jit(jax.vmap(lambda v: jax_kernel.moments(v, 0)))
    assert_same_bits(f(x), want)
    assert_same_bits(jax.vmap(lambda v: jax_kernel.moments(v, 0))(x), want)
    with jax.disable_jit():
        assert_same_bits(jax_kernel.moments(x, (1,)), oracle(x, (1,)))
    # vmap of stats: one undecided count per batch element
    xs = jnp.asarray(np.stack([x[0], np.full((20, 4), 1.0, np.float32)]))
    out = jax.vmap(lambda v: _moments.stats(v, (0,), 0, False, False, True, True))(xs)
    assert out[3].shape == (2,)
    # nested vmap: the leading dims all become the kernel's outer
    nested = jax.vmap(jax.vmap(lambda v: jax_kernel.moments(v, 0)))(x[:, None])
    assert_same_bits([o[:, 0] for o in nested], want)


def test_the_native_mean_lo_call_gives_the_bits_of_the_xla_formulation():
    """mean_lo from the native FFI call stable_mean_lo (moments.h `mean_lo`) against
    moments_core/_kernel.py `mean_lo` in XLA, on the same native mean and variance:
    offsets, mixed magnitudes, inputs near both ends of each format's range, a NaN,
    complex64; and stats(lo=True) native against XLA under vmap."""
    xla_lows = jax.jit(_moments._mean_lo_parts, static_argnums=(1, 2))
    for x, axes in datasets.mean_lo_cases():
        with jax.enable_x64(x.dtype == np.float64):
            means, var, _, lows = _moments._native_moments(jnp.asarray(x), axes, 0, lo=True)
            assert_same_bits(lows, xla_lows(jnp.asarray(x), axes, 0, means, var))
    xs = data((3, 20, 4), np.float32, offset=1e6)
    native, xla = (
        jax.vmap(lambda v, n=n: _moments.stats(v, (0,), 0, True, native=n))(xs)
        for n in (True, False)
    )
    assert_same_bits(native, xla)


@pytest.mark.parametrize("axes,ddof", [((0,), 1)] + ([((1,), 0)] if FULL else []))
def test_grad_matches_xla_path(axes, ddof):
    x = jnp.asarray(data((12, 5), np.float32, offset=1e4))
    w = jnp.asarray(np.random.default_rng(3).normal(size=5 if axes == (0,) else 12), np.float32)

    def loss(native):
        def f(v):
            mean, var = _moments._moments(v, axes, False, ddof, False, native)
            return jnp.sum(w * mean) + jnp.sum(w * var)

        return f

    got = jax.jit(jax.grad(loss(True)))(x)
    want = jax.jit(jax.grad(loss(False)))(x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    def public(v):  # the public function, eagerly differentiated
        mean, var = jax_kernel.moments(v, axes, ddof=ddof)
        return jnp.sum(w * mean) + jnp.sum(w * var)

    np.testing.assert_allclose(jax.grad(public)(x), got, rtol=1e-6, atol=1e-6)


def test_second_order_derivatives_do_not_differentiate_the_ffi_call():
    x = jnp.asarray(data((5, 2), np.float32, offset=1e6))
    n, ddof = 5, 1
    hessian = jax.hessian(lambda v: jax_kernel.moments(v, 0, ddof=ddof)[1][0])(x)
    expected = np.zeros((5, 2, 5, 2), np.float32)
    expected[:, 0, :, 0] = 2.0 / (n - ddof) * (np.eye(n) - 1.0 / n)
    np.testing.assert_allclose(hessian, expected, rtol=1e-5, atol=1e-6)


def test_fallback_env_switch(monkeypatch):
    x = data((5, 9), np.complex64, offset=1e5)
    native = jax_kernel.moments(x, 1)
    monkeypatch.setenv("TF_STABLE_MOMENTS_NATIVE", "0")
    assert not _native.enabled() and not _moments._use_native()
    assert _native.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switched off: no warning
        fallback = jax_kernel.moments(x, 1)
    assert_same_bits(native, fallback)
    assert_same_bits(native, oracle(x, (1,)))


def test_build_failure_warns_once_and_falls_back(monkeypatch, tmp_path):
    from moments_core.native import build

    monkeypatch.setattr(_native, "_STATE", {"tried": False, "lib": None, "error": None})
    monkeypatch.setattr(_native, "LIBRARY", str(tmp_path / "missing.so"))
    monkeypatch.setenv("TF_STABLE_MOMENTS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="native CPU moments kernel is unavailable"):
        assert _native.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        assert _native.load() is None and not _moments._use_native()
        x = data((4, 3), np.float32)
        assert_same_bits(jax_kernel.moments(x, 0), oracle(x, (0,)))


def test_exact_only_uses_xla(monkeypatch):
    monkeypatch.setenv("TF_STABLE_MOMENTS_EXACT_ONLY", "1")
    assert not _moments._use_native(_moments._exact_only())


def test_ffi_call_directly():
    """moments_call on [outer, n, inner, parts] with extra leading dims."""
    from moments_core._formats import FORMATS

    x = data((2, 3, 10, 4, 1), np.float32, offset=1e6)
    mean, var, undecided = _native.moments_call(jnp.asarray(x), 0, FORMATS["float32"])
    assert mean.shape == (2, 3, 4, 1) and var.shape == (2, 3, 4) and undecided.shape == ()
    m, v = oracle(x[..., 0], (2,))
    assert_same_bits([mean[..., 0], var], [m, v])
