"""Public JAX wrapper: validate and canonicalise, then call the jitted kernel."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_kernel import _ops
from moments_core import _kernel
from moments_core._formats import FORMATS
from moments_core._validate import canonical_axes, check_ddof

_HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _compute_dtype(dtype):
    """The dtype policy: each real format is its own target format; complex by parts."""
    dtype = np.dtype(dtype)
    if dtype in _HALF_DTYPES or dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        return dtype
    if dtype == np.dtype(np.complex64):
        return np.dtype(np.float32)
    if dtype == np.dtype(np.complex128):
        return np.dtype(np.float64)
    raise TypeError(
        f"moments: x must have a floating or complex dtype "
        f"(float16, bfloat16, float32, float64, complex64, complex128); got dtype {dtype.name}"
    )


def _canonical_axes(axes, ndim):
    return canonical_axes(axes, ndim)


def _check_ddof(ddof):
    return check_ddof(ddof)


def _layout(x, axes):
    """x as a 2-D array whose slices run along axis 0 (leading axes) or 1."""
    ndim = x.ndim
    kept = [a for a in range(ndim) if a not in axes]
    n = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    rest = int(np.prod([x.shape[a] for a in kept], dtype=np.int64))
    if axes == tuple(range(len(axes))):
        return x.reshape(n, rest), 0
    if axes != tuple(range(ndim - len(axes), ndim)):
        x = jnp.transpose(x, kept + list(axes))
    return x.reshape(rest, n), 1


def _out_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if a in axes else d for a, d in enumerate(shape))
    return tuple(d for a, d in enumerate(shape) if a not in axes)


def _exact_only():
    """Test switch: TF_STABLE_MOMENTS_EXACT_ONLY=1 sends every slice through the exact path."""
    return os.environ.get("TF_STABLE_MOMENTS_EXACT_ONLY", "0") == "1"


def _kernel_parts(x, axes):
    """(parts, axis, fmt, work): x's real parts laid out in 2-D, in their target format."""
    work = _compute_dtype(x.dtype)
    parts = [x] if not jnp.iscomplexobj(x) else [jnp.real(x), jnp.imag(x)]
    laid = [_layout(p.astype(work), axes) for p in parts]
    return [p for p, _ in laid], laid[0][1], FORMATS[work.name], work


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _fast(x, axes, ddof, exact_only):
    parts, axis, fmt, _ = _kernel_parts(x, axes)
    with jax.enable_x64(True):
        return _kernel.fast_moments(_ops, parts, axis, ddof, fmt, None, exact_only)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _exact(x, axes, ddof, todo, means, var, sums):
    parts, axis, fmt, _ = _kernel_parts(x, axes)
    with jax.enable_x64(True):
        return _kernel.exact_fix(
            _ops, parts, axis, ddof, fmt, None, todo, list(means), var, list(sums)
        )


def _concrete_moments(x, axes, keepdims, ddof, exact_only):
    """moments of a concrete array: the fast path, then the exact path only if needed
    (two XLA computations: a shape whose slices are all decided never compiles the
    exact path)."""
    work = _compute_dtype(x.dtype)
    with jax.enable_x64(True):
        means, var, todo, sums = _fast(x, axes, ddof, exact_only)
        if bool(jnp.any(todo)):
            means, var = _exact(x, axes, ddof, todo, means, var, sums)
        means = [m.astype(work) for m in means]
        var = var.astype(work)
    mean = means[0] if len(means) == 1 else lax.complex(means[0], means[1])
    shape = _out_shape(x.shape, axes, keepdims)
    return mean.reshape(shape), var.reshape(shape)


def stats(x, axes, ddof, lo=True, exact_only=False, undecided=False):
    """(mean, mean_lo, var) in the target format, shaped like the kept axes.

    mean and var are correctly rounded (moments_core/_kernel.py, with 64-bit
    types enabled for the kernel only); mean_lo (None unless lo) is
    mean(x) - mean from a deterministic fixed-point sum.  With undecided=True,
    also the number of slices the fast path left to the exact path.
    """
    parts, axis, fmt, work = _kernel_parts(x, axes)
    with jax.enable_x64(True):
        means, var, count = _kernel.slice_moments(_ops, parts, axis, ddof, fmt, None, exact_only)
        lows = None
        if lo:
            lows = [_kernel.mean_lo(_ops, p, axis, m, var, ddof, fmt) for p, m in zip(parts, means)]
            lows = [m.astype(work) for m in lows]
        means = [m.astype(work) for m in means]
        var = var.astype(work)
        count = count.astype(np.int32)
    shape = _out_shape(x.shape, axes, False)
    mean = means[0] if len(means) == 1 else lax.complex(means[0], means[1])
    mean_lo = None
    if lo:
        mean_lo = lows[0] if len(lows) == 1 else lax.complex(lows[0], lows[1])
        mean_lo = mean_lo.reshape(shape)
    out = (mean.reshape(shape), mean_lo, var.reshape(shape))
    return out + (count,) if undecided else out


def undecided_fraction(x, axes, ddof=0):
    """The fraction of slices of x that the fast path left to the exact path (diagnostics)."""
    x = jnp.asarray(x)
    axes = _canonical_axes(axes, x.ndim)
    count = jax.jit(stats, static_argnums=(1, 2, 3, 4, 5))(x, axes, ddof, False, False, True)[3]
    kept = int(np.prod([x.shape[a] for a in range(x.ndim) if a not in axes]))
    return int(count) / max(kept, 1)


def residuals(x, mean_hi, mean_lo, axes):
    """x - mean from the mean's two parts, differentiable as x - mean(x)."""
    # Zero in value (no overflow near the float maximum), mean(dx) in derivative.
    linear = jnp.mean(x - lax.stop_gradient(x), axis=axes, keepdims=True)
    return ((x - lax.stop_gradient(mean_hi)) - lax.stop_gradient(mean_lo)) - linear


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _moments_real(x, axes, ddof, exact_only):
    mh, _, var = stats(x, axes, ddof, False, exact_only)
    return mh, var


@_moments_real.defjvp
def _moments_real_jvp(axes, ddof, exact_only, primals, tangents):
    (x,), (dx,) = primals, tangents
    mh, ml, var = stats(x, axes, ddof, True, exact_only)
    n = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    r = residuals(x, jnp.expand_dims(mh, axes), jnp.expand_dims(ml, axes), axes)
    # A slice with NaN or Inf gets a zero variance gradient: its NaN residuals must
    # not reach other slices through the transposed product (0 * NaN).
    r = jnp.where(jnp.expand_dims(jnp.isfinite(var), axes), r, jnp.zeros_like(r))
    dmean = jnp.sum(dx, axis=axes) / n
    dvar = 2 * jnp.sum(r * dx, axis=axes) / (n - ddof)
    return (mh, var), (dmean.astype(mh.dtype), dvar.astype(var.dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _moments(x, axes, keepdims, ddof, exact_only):
    if jnp.iscomplexobj(x):
        mean, _, var = stats(x, axes, ddof, False, exact_only)
    else:
        mean, var = _moments_real(x, axes, ddof, exact_only)
    shape = _out_shape(x.shape, axes, keepdims)
    return mean.reshape(shape), var.reshape(shape)


def moments(x, axes, keepdims=False, *, ddof=0):
    """Mean and variance of `x` over `axes`, correctly rounded in float32/float64.

    Same semantics as ``tf_stable_moments.moments`` (without `shift`): the
    variance is sum((x - mean)**2) / (n - ddof) with n the number of reduced
    elements, rounded once; the mean is rounded once, each certified (docs
    section 5).  float16 and bfloat16 results are correctly rounded to their own
    format; complex inputs give a complex mean
    and the real variance E|z - mean z|**2.  Works under jax.jit, jax.vmap,
    jax.grad, jax.jvp and jax.hessian (real inputs).

    Args:
      x: array of a floating or complex dtype.
      axes: int, sequence of ints, or None for all axes.
      keepdims: keep reduced axes with length 1.
      ddof: delta degrees of freedom, a non-negative int.

    Returns:
      (mean, variance).  See docs/algorithm.md for the algorithm and its contract.

    >>> import jax.numpy as jnp
    >>> mean, var = moments(jnp.array([1e10, 1e10, 1e10], jnp.float32), axes=0)
    >>> float(var)
    0.0
    """
    x = jnp.asarray(x)
    _compute_dtype(x.dtype)
    axes = _canonical_axes(axes, x.ndim)
    ddof = _check_ddof(ddof)
    if not isinstance(x, jax.core.Tracer):
        return _concrete_moments(x, axes, bool(keepdims), ddof, _exact_only())
    return _moments(x, axes, bool(keepdims), ddof, _exact_only())
