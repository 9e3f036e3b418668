"""The input centred with the certified statistics, differentiable: the core of the Flax
modules (jax_kernel.flax.linen) and of `standardize`.

centre(x, mask, axes, axis_name, groups) -> (r, mean, var): mean and var the correctly
rounded statistics of the selected elements over `axes` (of every device on axis_name),
r = (x - mean) - mean_lo for every element, mean + mean_lo the mean to about twice the
format's precision (docs section 9).  Its JVP is the analytic one of
r = x - mean(x), var = mean((x - mean(x))**2) over the selected elements:

    d mean = sum(w t) / k,   d r = t - d mean,   d var = 2 sum(w r d r) / k = 2 sum(w r t) / k

(w the selection, k its count; sum(w r) = 0; sums psum-ed over axis_name, the two of
a step in one collective), itself differentiable.
"""

import functools
import math

import jax
import jax.numpy as jnp

from jax_kernel import _functions, _output, _union
from jax_kernel import _moments as _m


def expand(v, axes):
    return jnp.expand_dims(v, axes)


def _stats(x, mask, axes):
    """(mean, mean_lo, var) of x over axes (of the elements mask selects)."""
    if mask is None:
        return _m.stats(x, axes, 0)
    return _functions._masked_stats(x, mask, axes, 0, True, _m._exact_only())


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def centre(x, mask, axes, axis_name=None, groups=None):
    """(r, mean, var): r = (x - mean) - mean_lo for every element, mean and var those of
    the selected ones (all with mask None; of every device on axis_name), correctly
    rounded."""
    if axis_name is None:
        mean, mean_lo, var = _stats(x, mask, axes)
    else:
        mean, mean_lo, var = _union.union_stats(x, mask, axes, axis_name, groups)
    return (x - expand(mean, axes)) - expand(mean_lo, axes), mean, var


@centre.defjvp
def _centre_jvp(axes, axis_name, groups, primals, tangents):
    x, mask = primals
    t = tangents[0]
    r, mean, var = out = centre(x, mask, axes, axis_name, groups)

    def totals(*values):  # the sums of each over axes (and devices), stacked
        v = jnp.stack([jnp.sum(v, axes) for v in values])
        return v if axis_name is None else jax.lax.psum(v, axis_name, axis_index_groups=groups)

    w = 1.0 if mask is None else jnp.broadcast_to(mask, x.shape).astype(x.dtype)
    if mask is None:  # a static count: no collective
        devices = 1 if axis_name is None else _union.group_size(axis_name, groups)
        k = max(math.prod(x.shape[a] for a in axes) * devices, 1)
    else:
        k = jnp.maximum(totals(w)[0], 1)  # w: the selection, x's shape (as TF's `_counts`)
    # d var = 2 sum(w r (t - d mean)) / k = 2 sum(w r t) / k: sum(w (x - mean)) is 0.
    # The two sums are independent: one collective (and one in the transposed, backward
    # pass) of both.
    wt = w * t
    sums = totals(wt, wt * r)
    t_mean = sums[0] / k
    t_var = 2 * sums[1] / k
    return out, (t - expand(t_mean, axes), t_mean, t_var)


_ALGORITHMS = ("fast", "stable")


def standardize(
    x, axis=-1, mean=None, variance=None, epsilon=1e-5, where=None, *, algorithm="fast"
):
    """Standardize to zero mean and unit variance: a drop-in for jax.nn.standardize.

        y = (x - mean) / sqrt(variance + epsilon)

    With mean and variance not given, they are the correctly rounded mean and variance of
    the elements `where` selects (all by default) over `axis`, and x - mean is taken
    with the mean's two parts (docs section 9): accurate for data far from zero, and the
    same bits in eager mode and under jit (jax.nn.standardize's default
    ``mean(x**2) - mean(x)**2`` gives NaN or 0 for a small spread on a large offset, and
    differs between eager and jit: jax issues #30426, #37281).  `algorithm` ("fast" or
    "stable") is accepted and changes nothing then.  A given mean is used as given; a
    given variance too; with a mean given and no variance, the variance is jax's
    (``algorithm``'s formula about the given mean, not certified).  The output is
    RN(r * RN(1 / sqrt(variance + epsilon))) for float32 and float64 (docs section 14:
    the same bits on every machine, where XLA's rsqrt varies in its last bit), the plain
    expression for other dtypes.  Integer input is cast to the default float dtype, as
    jnp.mean does.  Gradients are analytic.

    Args:
      x: a real array.
      axis: None (all axes), an int or a tuple of ints; default the last axis.
      mean, variance: optional, broadcastable to x with the reduced axes kept.
      epsilon: added to the variance.
      where: optional boolean mask broadcast to x: the elements of the statistics.

    >>> import jax.numpy as jnp, jax_kernel
    >>> x = jnp.array([[1e4 + 1, 1e4 + 2, 1e4 + 3]], jnp.float32)
    >>> jax_kernel.standardize(x, epsilon=0.0)
    Array([[-1.2247448,  0.       ,  1.2247448]], dtype=float32)
    """
    from moments_core._validate import canonical_axes

    if algorithm not in _ALGORITHMS:
        raise ValueError(
            f"standardize: algorithm must be one of {_ALGORITHMS}; got algorithm={algorithm!r}"
        )
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            raise TypeError(f"standardize: x must be real; got dtype {x.dtype}")
        x = x.astype(jnp.result_type(float))
    axes = canonical_axes(axis, x.ndim, "standardize", arg="axis")
    mask = None if where is None else jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    if mean is None:
        r, _, var = centre(x, mask, axes)
        var = expand(var, axes)
    else:
        r = x - jnp.asarray(mean)
        var = None
    if variance is not None:
        var = jnp.asarray(variance)
    elif var is None:  # a mean given, no variance: jax's formulas about that mean
        if algorithm == "stable":
            var = jnp.mean(jnp.square(r), axes, keepdims=True, where=mask)
        else:
            m = jnp.asarray(mean)
            var = jnp.mean(jnp.square(x), axes, keepdims=True, where=mask) - jnp.square(m)
            var = jnp.clip(var, 0)
    return _output.scale_shift(r, var + epsilon)  # the layers' formula (docstring)
