"""Drop-ins for jnp.mean, jnp.var and jnp.std on the certified kernel.

mean and var are correctly rounded (the exact mean and variance of the selected
input floats, rounded once; docs/algorithm.md).  std is sqrt of the exact
variance: it is computed as RN_p(fl64(sqrt(RN_53(var)))), the variance
correctly rounded to float64 by the kernel (the input read as float64, after the
flush of its own format), its float64 square root, rounded once to the output
format.  With v the exact variance and s = fl64(sqrt(RN_53(v))):

    |s - sqrt(v)| <= (2**-54 + 2**-53) (1 + 2**-52) sqrt(v)
    |result - sqrt(v)| <= ulp/2 + 1.5 * 2**(p - 53) ulp

so float16/bfloat16/float32 std is within 0.5 + 2**-28.4 ulp of the exact
value (it differs from the correctly rounded one only when sqrt(v) lies within
a relative 1.5 * 2**-53 of a rounding midpoint), and float64 std is faithful
(below 1 ulp).  A correctly rounded square root of a rational number would need
an exact integer square root in the exact path; not done.

where= (a boolean mask broadcast to the input): the kernel is told the count of
selected elements per slice, and every unselected element is replaced by the
slice's first selected one, so the fast sums see exact zeros for them and the
exact path masks them: the result is the correctly rounded statistic of the
selected elements.  Masked calls run the XLA kernel (the native kernel has no
masks), compiled per shape.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_kernel import _moments as _m
from jax_kernel import _ops
from jax_kernel._state import _wide_var
from moments_core import _kernel, _state
from moments_core._formats import FORMATS
from moments_core._validate import canonical_axes, check_ddof, out_shape

__all__ = ["mean", "std", "var"]


def _check_out(out, fn):
    if out is not None:
        raise NotImplementedError(
            f"{fn}: the out argument is not supported (JAX arrays are "
            f"immutable); got out={type(out).__name__}"
        )


def _check_mean(mean, fn):
    if mean is not None:
        raise NotImplementedError(
            f"{fn}: the mean argument is not supported (the kernel "
            "computes the exact mean itself); got a mean"
        )


def _ddof(ddof, correction, fn):
    if correction is None:
        return check_ddof(ddof, fn)
    if not (isinstance(ddof, (int, np.integer)) and not isinstance(ddof, bool) and ddof == 0):
        raise ValueError(
            f"{fn}: ddof and correction cannot both be given; got ddof={ddof!r}, "
            f"correction={correction!r}"
        )
    if not isinstance(correction, (int, np.integer)) or isinstance(correction, (bool, np.bool_)):
        raise ValueError(
            f"{fn}: correction must be a non-negative int; got correction={correction!r}"
        )
    return check_ddof(correction, fn)


def _prepare(fn, a, axis, dtype, keepdims, where, ddof=0):
    """(x in its computation dtype, mask or None, axes, output dtype of jnp's `fn`)."""
    a = jnp.asarray(a)
    axes = canonical_axes(axis, a.ndim, fn, arg="axis")
    ref = getattr(jnp, fn)
    spec = jax.ShapeDtypeStruct(a.shape, a.dtype)
    # The dtypes jnp would give (the shape is ours: the tests compare both).
    work = jax.eval_shape(lambda t: jnp.mean(t, axes, dtype=dtype), spec).dtype
    out_dtype = jax.eval_shape(lambda t: ref(t, axes, dtype=dtype), spec).dtype
    x = a.astype(work)
    _m._compute_dtype(x.dtype)
    mask = None
    if where is not None:
        mask = jnp.broadcast_to(jnp.asarray(where, bool), a.shape)
    return x, mask, axes, np.dtype(out_dtype)


# ------------------------------------------------------------------ masked kernel
def _masked_parts(x, mask, axes):
    """(parts, valid, n, axis, fmt, work): the parts laid out, unselected elements
    replaced by their slice's first selected one (0 where none is), the mask laid
    out alike and the count per slice (int64; call with 64-bit types enabled)."""
    parts, axis, fmt, work = _m._kernel_parts(x, axes)
    valid = _m._layout(mask, axes)[0]
    n = jnp.sum(valid, axis=axis, dtype=jnp.int64)
    size = valid.shape[axis]
    where_selected = jnp.where(valid, lax.broadcasted_iota(jnp.int32, valid.shape, axis), size)
    first = jnp.minimum(jnp.min(where_selected, axis=axis, keepdims=True), max(size - 1, 0))
    some = jnp.expand_dims(n > 0, axis)
    out = []
    for p in parts:
        k = jnp.where(some, jnp.take_along_axis(p, first, axis), jnp.zeros((), p.dtype))
        out.append(jnp.where(valid, p, k))
    return out, valid, n, axis, fmt, work


def _masked_stats(x, mask, axes, ddof, lo, exact_only):
    """(mean, mean_lo or None, var) of the selected elements, shaped like the kept axes."""
    with jax.enable_x64(True):
        parts, valid, n, axis, fmt, work = _masked_parts(x, mask, axes)
        f32 = _kernel.f32_pairs()
        means, var, _ = _kernel.slice_moments(
            _ops, parts, axis, ddof, fmt, n, exact_only, valid, f32
        )
        lows = None
        if lo:
            lows = [
                _kernel.mean_lo(_ops, p, axis, m, var, ddof, fmt, n, valid).astype(work)
                for p, m in zip(parts, means)
            ]
        means = [m.astype(work) for m in means]
        var = var.astype(work)
    shape = out_shape(x.shape, axes, False)

    def join(v):
        return (v[0] if len(v) == 1 else lax.complex(v[0], v[1])).reshape(shape)

    return join(means), (join(lows) if lo else None), var.reshape(shape)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _masked_real(x, mask, axes, ddof, exact_only):
    mh, _, var = _masked_stats(x, mask, axes, ddof, False, exact_only)
    return mh, var


@_masked_real.defjvp
def _masked_real_jvp(axes, ddof, exact_only, primals, tangents):
    (x, mask), (dx, _) = primals, tangents
    mh, var = _masked_real(x, mask, axes, ddof, exact_only)
    xs = lax.stop_gradient(x)
    _, ml, _ = _masked_stats(xs, mask, axes, ddof, True, exact_only)
    n = jnp.sum(mask, axis=axes).astype(x.dtype)
    r = _m.residuals(x, jnp.expand_dims(mh, axes), jnp.expand_dims(ml, axes), axes)
    keep = mask & jnp.expand_dims(jnp.isfinite(var), axes)
    r = jnp.where(keep, r, jnp.zeros_like(r))
    dxm = jnp.where(mask, dx, jnp.zeros_like(dx))
    dmean = jnp.sum(dxm, axis=axes) / n
    dvar = 2 * jnp.sum(r * dxm, axis=axes) / (n - ddof)
    return (mh, var), (dmean.astype(mh.dtype), dvar.astype(var.dtype))


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _masked_moments(x, mask, axes, keepdims, ddof, exact_only):
    if jnp.iscomplexobj(x):
        mean_, _, var_ = _masked_stats(x, mask, axes, ddof, False, exact_only)
    else:
        mean_, var_ = _masked_real(x, mask, axes, ddof, exact_only)
    shape = out_shape(x.shape, axes, keepdims)
    return mean_.reshape(shape), var_.reshape(shape)


def _moments(x, mask, axes, keepdims, ddof):
    if mask is None:
        return _m.moments(x, axes, keepdims, ddof=ddof)
    return _masked_moments(x, mask, axes, bool(keepdims), ddof, _m._exact_only())


# ------------------------------------------------------------------ std
def _wide(x, fmt):
    """x flushed to its format's normal range, as float64 (complex128): exact."""
    tiny = 2.0**fmt.emin
    if jnp.iscomplexobj(x):
        re, im = (jnp.real(x).astype(jnp.float64), jnp.imag(x).astype(jnp.float64))
        re = jnp.where(jnp.abs(re) < tiny, 0.0, re)
        im = jnp.where(jnp.abs(im) < tiny, 0.0, im)
        return lax.complex(re, im)
    w = x.astype(jnp.float64)
    return jnp.where(jnp.abs(w) < tiny, 0.0, w)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _std_value(x, mask, axes, keepdims, ddof):
    work = _m._compute_dtype(x.dtype)
    fmt = FORMATS[work.name]
    with jax.enable_x64(True):
        if _state.one_pass_applies(fmt) and math.prod(x.shape[a] for a in axes) >= (
            _state.STD_FROM_STATE
        ):
            v = _wide_var(x, mask, axes, ddof).reshape(out_shape(x.shape, axes, keepdims))
        else:
            _, v = _moments(_wide(x, fmt), mask, axes, keepdims, ddof)
        s = jnp.sqrt(v)
        s = jnp.where(jnp.isfinite(s), _kernel.round_to(_ops, s, fmt), s)
        return s.astype(work)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _std_real(x, mask, axes, keepdims, ddof):
    return _std_value(x, mask, axes, keepdims, ddof)


@_std_real.defjvp
def _std_real_jvp(axes, keepdims, ddof, primals, tangents):
    (x, mask), (dx, _) = primals, tangents
    s = _std_real(x, mask, axes, keepdims, ddof)
    _, dvar = jax.jvp(lambda t: _moments(t, mask, axes, keepdims, ddof)[1], (x,), (dx,))
    return s, (dvar / (2 * s)).astype(s.dtype)


# ------------------------------------------------------------------ public functions
def mean(a, axis=None, dtype=None, out=None, keepdims=False, *, where=None):
    """Correctly rounded mean: a drop-in for jnp.mean.

    mean = (1/n) sum x_i over the n elements of each slice (selected by `where`),
    the exact value for the input floats rounded once to the result dtype
    (docs/algorithm.md).  The result dtype is jnp.mean's (integer and bool inputs
    are cast to it first, as jnp does; with `dtype` the input is cast to dtype,
    which may round).  A slice with no selected element gives NaN.

    Args:
      a: array.
      axis: None (all axes), an int or a tuple of ints.
      dtype: the computation and result dtype, as in jnp.mean.
      out: must be None (not supported by JAX either).
      keepdims: keep reduced axes with length 1.
      where: optional boolean mask broadcast to a: only its True elements count.
    """
    _check_out(out, "mean")
    x, mask, axes, out_dtype = _prepare("mean", a, axis, dtype, keepdims, where)
    return _moments(x, mask, axes, keepdims, 0)[0].astype(out_dtype)


def var(
    a,
    axis=None,
    dtype=None,
    out=None,
    ddof=0,
    keepdims=False,
    *,
    where=None,
    mean=None,
    correction=None,
):
    """Correctly rounded variance: a drop-in for jnp.var.

    var = (1/(n - ddof)) sum (x_i - mean)**2 over the n (selected) elements of
    each slice, exact, rounded once to the result dtype (real for complex input:
    E|z - mean z|**2).  ddof (or its alias correction) must be a non-negative
    int.  Where n - ddof <= 0 the result is NaN (jnp divides by n - ddof and
    gives inf or a negative value there).  `mean` (a precomputed mean) is not
    supported: NotImplementedError.
    """
    _check_out(out, "var")
    _check_mean(mean, "var")
    ddof = _ddof(ddof, correction, "var")
    x, mask, axes, out_dtype = _prepare("var", a, axis, dtype, keepdims, where)
    return _moments(x, mask, axes, keepdims, ddof)[1].astype(out_dtype)


def std(
    a,
    axis=None,
    dtype=None,
    out=None,
    ddof=0,
    keepdims=False,
    *,
    where=None,
    mean=None,
    correction=None,
):
    """Standard deviation sqrt(var): a drop-in for jnp.std.

    Not correctly rounded in general (a square root of the exact variance):
    computed from the variance correctly rounded to float64, within
    0.5 + 1.5 * 2**(p - 53) ulp of the exact value for a result of precision p
    (float16/bfloat16/float32: 0.5 + 2**-28.4 ulp; float64: below 1 ulp).  See the
    module docstring.  Arguments as in `var`.
    """
    _check_out(out, "std")
    _check_mean(mean, "std")
    ddof = _ddof(ddof, correction, "std")
    x, mask, axes, out_dtype = _prepare("std", a, axis, dtype, keepdims, where)
    if jnp.iscomplexobj(x):
        return _std_value(x, mask, axes, keepdims, ddof).astype(out_dtype)
    return _std_real(x, mask, axes, keepdims, ddof).astype(out_dtype)
