"""Statistics of the union of every device's data on a named axis (inside shard_map or
pmap): the certified merge of docs/algorithm.md section 13b, and the public `moments`
with `axis_name` (one device: jax_kernel/_moments.py).

One all-reduce of each device's fast sums and their error bounds decides the slices of
the union; exact moments states (one psum of int32 digits) only for the slices it leaves
open, in a branch every device takes together.  `union_stats` adds the layers' mean_lo,
its sums sent with the count of open slices.
"""

import functools
import math

import jax
import jax.numpy as jnp

from jax_kernel import _moments as _m
from jax_kernel import _ops
from jax_kernel import _state as _state_api
from moments_core import _kernel
from moments_core._formats import FORMATS
from moments_core._validate import out_shape

__all__ = ["moments"]


# Benchmarks only (benchmarks/sync.py --jax): True sends every format through the exact
# states, the path before the certified merge.
_sync_exact_states = False


def group_size(axis_name, groups):
    """How many devices form one union: the axis's size, or a group's."""
    return jax.lax.axis_size(axis_name) if groups is None else len(groups[0])


def _all_sum(axis_name, groups):
    def all_sum(t):
        return jax.lax.psum(t, axis_name, axis_index_groups=groups)

    return all_sum


def _mergeable(x):
    """Whether the certified merge serves x's dtype: float32, float16 and bfloat16 (complex
    and float64 have no merged bound of two parts or pairs yet: the exact states)."""
    if jnp.iscomplexobj(x) or _sync_exact_states:
        return False
    return FORMATS[jnp.dtype(x.dtype).name].wide


def _merge(x, mask, axes, axis_name, groups, ddof):
    """The certified merge (under enable_x64): (laid, axis, valid, m64, v64, todo, n), x
    and mask laid out, the union's float64 mean and variance (the format's values where
    decided), the slices left open and the union's count (`_kernel.merge_fast`)."""
    fmt = FORMATS[jnp.dtype(x.dtype).name]
    size = group_size(axis_name, groups)
    laid, axis = _m._layout(x, axes)
    valid = None if mask is None else _m._layout(mask, axes)[0]
    count = None if mask is None else jnp.sum(valid, axis).astype(jnp.int64)
    shift = _leader_sum(axis_name, groups)
    all_sum = _all_sum(axis_name, groups)
    m64, v64, todo, n = _kernel.merge_fast(
        _ops, laid, axis, fmt, shift, all_sum, size, count, valid, ddof
    )
    return laid, axis, valid, m64, v64, todo, n


def _exact_states(x, mask, axes, axis_name, groups, ddof):
    """(mean, var) of the union from every device's exact state, one psum of its digits."""
    state = _all_sum(axis_name, groups)(_state_api.moments_state(x, axes, where=mask))
    return _state_api.state_moments(state, ddof)


def _replace_open(todo, x, mask, axes, axis_name, groups, ddof, m64, v64):
    """m64, v64 with the open slices' values from the exact states (float64, flat)."""
    em, ev = (
        t.reshape(-1).astype(jnp.float64)
        for t in _exact_states(x, mask, axes, axis_name, groups, ddof)
    )
    return jnp.where(todo, em, m64), jnp.where(todo, ev, v64)


def union_moments(x, mask, axes, axis_name, groups=None, ddof=0):
    """(mean, var) of the union of every device's x on `axis_name` (within its group of
    `groups`; of the elements `mask` selects), the bits of one device holding all.
    Inside shard_map or pmap.

    float32, float16 and bfloat16: the certified merge (docs section 13b): one all-reduce
    of each device's fast sums and their bounds (against a shift that one device of each
    group gives), the rounding test on the global sums; only if some slice is left open
    (a condition every device computes from a max over all devices: all take the same
    branch) the exact states of the slices, one psum of their int32 digits.  float64:
    the exact states always."""
    if not _mergeable(x):
        return _exact_states(x, mask, axes, axis_name, groups, ddof)
    kept_shape = out_shape(x.shape, axes, False)
    with jax.enable_x64(True):
        _, _, _, m64, v64, todo, _ = _merge(x, mask, axes, axis_name, groups, ddof)
        opened = jax.lax.pmax(jnp.sum(todo.astype(jnp.int32)), axis_name)
        exact = functools.partial(_replace_open, todo, x, mask, axes, axis_name, groups, ddof)
        m64, v64 = jax.lax.cond(opened > 0, exact, lambda m, v: (m, v), m64, v64)
        return tuple(t.astype(x.dtype).reshape(kept_shape) for t in (m64, v64))


def union_stats(x, mask, axes, axis_name, groups=None, n=None):
    """(mean, mean_lo, var) of the union (ddof 0; section 9's mean_lo, from fixed-point
    sums: integers below 2**53, exact in any order), the bits of one device holding
    all: the layers' statistics.

    The certified merge as in `union_moments`; then mean_lo's fixed-point sums of the
    decided statistics and the count of open slices go in one psum (integers: every
    device gets the same count, so all take the same branch).  Only if some slice is
    open: the exact states, and mean_lo's sums again (a second psum in that branch).
    So a step on decided data has three collectives: the shift, the fast sums, and
    this one (with axis_index_groups a scalar pmax over all devices more, so that every
    group takes the same branch, as `union_moments` does).  n: None, or the union's
    count as a Python int where a selection only pads (the Keras layer's batch padded to
    a multiple of the devices), so that mean_lo folds the constants of one device's
    kernel."""
    kept_shape = out_shape(x.shape, axes, False)
    fmt = FORMATS[jnp.dtype(x.dtype).name]
    all_sum = _all_sum(axis_name, groups)
    with jax.enable_x64(True):

        def lows(m64, v64, n, laid, axis, valid):
            return _kernel.mean_lo(_ops, laid, axis, m64, v64, 0, fmt, n, valid, reduce=all_sum)

        def result(m64, v64, lo):
            return tuple(t.astype(x.dtype).reshape(kept_shape) for t in (m64, lo, v64))

        if not _mergeable(x):
            mean, var = _exact_states(x, mask, axes, axis_name, groups, 0)
            laid, axis = _m._layout(x, axes)
            valid = None if mask is None else _m._layout(mask, axes)[0]
            if n is None and mask is not None:
                n = all_sum(jnp.sum(valid, axis).astype(jnp.int64))
            if n is None:  # a static count: the constants of one device's kernel
                size = group_size(axis_name, groups)
                n = math.prod(x.shape[a] for a in axes) * size
            m64, v64 = (t.reshape(-1).astype(jnp.float64) for t in (mean, var))
            return result(m64, v64, lows(m64, v64, n, laid, axis, valid))
        laid, axis, valid, m64, v64, todo, count = _merge(x, mask, axes, axis_name, groups, 0)
        n = count if n is None else n
        # The values the caller gets (a float16 mean beyond its range is inf: no mean_lo).
        m64, v64 = (t.astype(x.dtype).astype(jnp.float64) for t in (m64, v64))
        total, unscale, ok = _kernel.mean_lo_sums(_ops, laid, axis, m64, v64, 0, fmt, n, valid)
        opened = jnp.sum(todo.astype(jnp.float64), keepdims=True)
        reduced = all_sum(jnp.concatenate([total, opened]))

        def decided(m64, v64):
            return m64, v64, _kernel.mean_lo_round(_ops, reduced[:-1], unscale, ok, n, fmt)

        def exact(m64, v64):
            m64, v64 = _replace_open(todo, x, mask, axes, axis_name, groups, 0, m64, v64)
            return m64, v64, lows(m64, v64, n, laid, axis, valid)

        opened = reduced[-1]
        if groups is not None:  # all groups take one branch, as in `union_moments`
            opened = jax.lax.pmax(opened, axis_name)
        return result(*jax.lax.cond(opened > 0, exact, decided, m64, v64))


def _leader_sum(axis_name, groups):
    """(k, has) -> per slice the k of the first device of its group that has one (has:
    None when every device has), on every device of the group: a psum in which that
    device alone contributes (exact, in any order); a pmin of the device indices first
    when a selection may leave a device without elements."""
    leaders = [0] if groups is None else [g[0] for g in groups]

    def shift(k, has):
        me = jax.lax.axis_index(axis_name)
        if has is None:
            lead = functools.reduce(jnp.logical_or, [me == i for i in leaders])
        else:
            big = jnp.iinfo(jnp.int32).max
            first = jax.lax.pmin(jnp.where(has, me, big), axis_name, axis_index_groups=groups)
            lead = has & (first == me)
        # K is an input of a format of precision <= 24: sent as float32 (4 bytes a slice).
        k32 = jnp.where(lead, k, 0.0).astype(jnp.float32)
        return jax.lax.psum(k32, axis_name, axis_index_groups=groups).astype(jnp.float64)

    return shift


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4))
def union_real(x, axes, ddof, axis_name, groups):
    """`union_moments` of real x without a selection, differentiable: the tangents of the
    mean and variance of the union, d mean = sum t / n and
    d var = 2 sum (x - mean) (t - d mean) / (n - ddof), sums psum-ed."""
    return union_moments(x, None, axes, axis_name, groups, ddof)


@union_real.defjvp
def _union_real_jvp(axes, ddof, axis_name, groups, primals, tangents):
    (x,), (t,) = primals, tangents
    mean, var = out = union_real(x, axes, ddof, axis_name, groups)

    def total(v):
        return jax.lax.psum(jnp.sum(v, axes), axis_name, axis_index_groups=groups)

    size = group_size(axis_name, groups)
    n = math.prod(x.shape[a] for a in axes) * size
    t_mean = total(t) / n
    r = x - jnp.expand_dims(mean, axes)
    t_var = 2 * total(r * (t - jnp.expand_dims(t_mean, axes))) / max(n - ddof, 1)
    return out, (t_mean, t_var)


def _union(x, axes, keepdims, ddof, axis_name, groups):
    """`moments` of the union over a named axis."""
    if axis_name is None:
        raise ValueError(
            "moments: axis_index_groups needs axis_name; got axis_name=None and "
            f"axis_index_groups={groups!r}"
        )
    if groups is not None:
        groups = tuple(tuple(int(i) for i in g) for g in groups)
        if len({len(g) for g in groups}) != 1:
            raise ValueError(
                f"moments: axis_index_groups must be groups of equal size; got {groups!r}"
            )
    if jnp.iscomplexobj(x):
        mean, var = union_moments(x, None, axes, axis_name, groups, ddof)
    else:
        mean, var = union_real(x, axes, ddof, axis_name, groups)
    shape = out_shape(x.shape, axes, keepdims)
    return mean.reshape(shape), var.reshape(shape)


def moments(x, axes, keepdims=False, *, ddof=0, axis_name=None, axis_index_groups=None):
    """Mean and variance of `x` over `axes`, correctly rounded; with `axis_name`, those of
    the union of every device's `x` on that axis.

    Without axis_name: ``jax_kernel._moments.moments`` (one device; see its docstring and
    docs/algorithm.md).  With it, inside ``shard_map`` or ``pmap``: the statistics of the
    union, the same on every device and the bits of one device holding all (the
    certified merge of docs section 13b), as ``jax.lax.pmean`` would average them;
    every device's `x` has the same shape.  Differentiable (real x): the tangents of the
    union's mean and variance, their sums psum-ed.

    Args:
      x: array of a floating or complex dtype.
      axes: int, sequence of ints, or None for all axes.
      keepdims: keep reduced axes with length 1.
      ddof: delta degrees of freedom, a non-negative int.
      axis_name: None, or a named axis of ``shard_map`` / ``pmap``.
      axis_index_groups: with axis_name, groups of device indices of equal size that
        each form a union of their own (as ``jax.lax.psum`` takes them).

    Returns:
      (mean, variance).

    >>> import jax.numpy as jnp
    >>> mean, var = moments(jnp.array([1e10, 1e10, 1e10], jnp.float32), axes=0)
    >>> float(var)
    0.0
    """
    if axis_name is None and axis_index_groups is None:
        return _m.moments(x, axes, keepdims, ddof=ddof)
    x = jnp.asarray(x)
    _m._compute_dtype(x.dtype)
    axes = _m._canonical_axes(axes, x.ndim)
    ddof = _m._check_ddof(ddof)
    return _union(x, axes, bool(keepdims), ddof, axis_name, axis_index_groups)
