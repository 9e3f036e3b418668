"""Public JAX wrapper: validate and canonicalise, then call the jitted kernel."""

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_kernel import _kernel

_HALF_DTYPES = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def _compute_dtype(dtype):
    """The dtype policy: float16/bfloat16 are computed in float32, complex by parts."""
    dtype = np.dtype(dtype)
    if dtype in _HALF_DTYPES:
        return np.dtype(np.float32)
    if dtype in (np.dtype(np.float32), np.dtype(np.float64)):
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
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, (int, np.integer)) and not isinstance(axes, bool):
        axes = (axes,)
    try:
        axes = tuple(operator.index(a) for a in axes)
    except TypeError:
        raise TypeError(
            f"moments: axes must be an int or a sequence of ints; got {axes!r}"
        ) from None
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"moments: axis {a} is out of range for an input of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"moments: axes contains a repeated axis; got axes={axes}")
    return tuple(sorted(out))


def _check_ddof(ddof):
    if isinstance(ddof, bool) or not isinstance(ddof, (int, np.integer)) or ddof < 0:
        raise ValueError(f"moments: ddof must be a non-negative int; got ddof={ddof!r}")
    return int(ddof)


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


def _padded_length(n, kept, axis):
    """n, or the next power of two where XLA's own padding of the tree is slow.

    The same policy as the TensorFlow wrapper (tf_stable_moments/_moments.py):
    along axis 1 always, along axis 0 for rows of at most 256 elements and
    inputs of at least 2**20 elements.  XLA fuses this padding into the kernel,
    and it still helps ([4000, 4000] along axis 1: 294 ms, padded 53 ms).
    """
    if n <= 1 or n & (n - 1) == 0:
        return n
    if axis == 1 or (kept <= 256 and n * kept >= 1 << 20):
        return 1 << (n - 1).bit_length()
    return n


def _pad_slices(p, axis, size):
    """Slices padded to `size` with copies of their first element (docs section 5)."""
    fill = list(p.shape)
    fill[axis] = size - p.shape[axis]
    first = lax.slice_in_dim(p, 0, 1, axis=axis)
    return jnp.concatenate([p, jnp.broadcast_to(first, fill)], axis)


def _out_shape(shape, axes, keepdims):
    if keepdims:
        return tuple(1 if a in axes else d for a, d in enumerate(shape))
    return tuple(d for a, d in enumerate(shape) if a not in axes)


def stats(x, axes, ddof):
    """(mean_hi, mean_lo, var) in the compute dtype, shaped like the kept axes."""
    parts = [x] if not jnp.iscomplexobj(x) else [jnp.real(x), jnp.imag(x)]
    laid = [_layout(p.astype(_compute_dtype(x.dtype)), axes) for p in parts]
    parts, axis = [p for p, _ in laid], laid[0][1]
    n = parts[0].shape[axis]
    size = _padded_length(n, parts[0].shape[1 - axis], axis)
    if size != n:
        parts = [_pad_slices(p, axis, size) for p in parts]
    means, var = _kernel.slice_moments(parts, axis, ddof, n)
    shape = _out_shape(x.shape, axes, False)
    if len(means) == 1:
        mh, ml = means[0]
    else:
        mh = lax.complex(means[0][0], means[1][0])
        ml = lax.complex(means[0][1], means[1][1])
    return mh.reshape(shape), ml.reshape(shape), var.reshape(shape)


def residuals(x, mean_hi, mean_lo, axes):
    """x - mean from the mean's two parts, differentiable as x - mean(x)."""
    # Zero in value (no overflow near the float maximum), mean(dx) in derivative.
    linear = jnp.mean(x - lax.stop_gradient(x), axis=axes, keepdims=True)
    return ((x - lax.stop_gradient(mean_hi)) - lax.stop_gradient(mean_lo)) - linear


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _moments_real(x, axes, ddof):
    mh, _, var = stats(x, axes, ddof)
    return mh, var


@_moments_real.defjvp
def _moments_real_jvp(axes, ddof, primals, tangents):
    (x,), (dx,) = primals, tangents
    mh, ml, var = stats(x, axes, ddof)
    n = int(np.prod([x.shape[a] for a in axes], dtype=np.int64))
    r = residuals(x, jnp.expand_dims(mh, axes), jnp.expand_dims(ml, axes), axes)
    dmean = jnp.sum(dx, axis=axes) / n
    dvar = 2 * jnp.sum(r * dx, axis=axes) / (n - ddof)
    return (mh, var), (dmean.astype(mh.dtype), dvar.astype(var.dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _moments(x, axes, keepdims, ddof):
    if jnp.iscomplexobj(x):
        mh, _, var = stats(x, axes, ddof)
        mean = mh
    else:
        mean, var = _moments_real(x.astype(_compute_dtype(x.dtype)), axes, ddof)
        mean, var = mean.astype(x.dtype), var.astype(x.dtype)
    shape = _out_shape(x.shape, axes, keepdims)
    return mean.reshape(shape), var.reshape(shape)


def moments(x, axes, keepdims=False, *, ddof=0):
    """Mean and variance of `x` over `axes`, correctly rounded in float32/float64.

    Same semantics as ``tf_stable_moments.moments`` (without `shift`): the
    variance is sum((x - mean)**2) / (n - ddof) with n the number of reduced
    elements, rounded once; the mean is rounded once.  float16 and bfloat16
    are computed in float32 and cast back; complex inputs give a complex mean
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
    return _moments(x, axes, bool(keepdims), ddof)
