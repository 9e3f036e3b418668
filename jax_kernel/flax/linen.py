"""flax.linen BatchNorm, LayerNorm and GroupNorm with correctly rounded statistics.

Each class subclasses Flax's and keeps its fields, defaults, variable collections
and names (``params``: ``scale``, ``bias``; ``batch_stats``: ``mean``, ``var``), so
an existing checkpoint loads and a model changes by one import:

    from jax_kernel.flax import linen as stable
    norm = stable.BatchNorm(use_running_average=False, momentum=0.9)

What differs is the arithmetic.  Flax computes var = E[x**2] - E[x]**2 in float32
(``use_fast_variance=True``, the default) and y = (x - mean) * rsqrt(var + eps): on
N(1e6, 1) data the outputs, of size 1, are off by hundreds.  Here

    mean, mean_lo, var = the kernel's statistics of the (selected) elements
    r = (x - mean) - mean_lo                       (mean + mean_lo: the mean to ~2p bits)
    y = r * (rsqrt(var + epsilon) * scale) + bias   (every rounding fixed: section 14)

in the dtype Flax uses for the statistics (at least float32); mean and var are the
exact values rounded once, the same bits on every platform and as
``jax_kernel.moments`` and ``tf_stable_moments.moments``.  ``use_fast_variance`` is
accepted and changes nothing (there is one result: the correctly rounded one).
Gradients are the analytic ones of the same formulas (a custom JVP: d mean = mean(t),
d var = 2 mean(r (t - d mean)) over the selected elements), so higher orders work.

axis_name (and axis_index_groups), inside ``pmap`` or ``shard_map``: the statistics of
every device's batch on that axis, the bits of one device holding all of it: the
certified merge of docs/algorithm.md section 13b (one all-reduce of each device's fast
sums and error bounds, the rounding test on the global sums; exact moments states,
one psum of their int32 digits, only for slices it leaves open) (Flax: one pmean of
float32 partial means).

Not yet: ``force_float32_reductions=False`` is treated as True (statistics of
half-precision inputs in float32).
"""

import flax.linen as nn
import jax.numpy as jnp
from flax.linen import dtypes as _dtypes
from flax.linen.module import compact, merge_param

from jax_kernel import _output
from jax_kernel._centre import centre as _centre
from jax_kernel._centre import expand as _expand

__all__ = ["BatchNorm", "GroupNorm", "LayerNorm"]


def _axes(ndim, axes):
    """Sorted non-negative axes from an int or a sequence (negative counted from the end)."""
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(sorted({a % ndim for a in axes}))


def _work(x, dtype):
    """The statistics dtype of Flax: x's (or `dtype`), at least float32."""
    return jnp.promote_types(jnp.result_type(x) if dtype is None else dtype, jnp.float32)


def _centred(x, mask, axes, dtype, axis_name=None, index_groups=None):
    """_centre of x in the statistics dtype, over axis_name (within index_groups)."""
    x = jnp.asarray(x, _work(x, dtype))
    if mask is not None:
        mask = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
    groups = None
    if axis_name is not None and index_groups is not None:
        groups = tuple(tuple(int(i) for i in g) for g in index_groups)
    return _centre(x, mask, axes, axis_name, groups)


def _group_axes(ndim, reduction_axes):
    """GroupNorm's reduction axes: given, or all but the first (the batch); the last
    (the features) must be among them."""
    given = reduction_axes
    if reduction_axes is None:
        reduction_axes = list(range(1, ndim - 1)) + [-1]
    axes = _axes(ndim, reduction_axes)
    if axes[-1] != ndim - 1:
        raise ValueError(
            "GroupNorm: the reduction axes must include the last (feature) axis; got "
            f"reduction_axes={given!r} for an input of rank {ndim}"
        )
    return axes


def _grouped(x, mask, reduction_axes, groups, centred):
    """GroupNorm's (r, var): the statistics of each group of consecutive channels over
    reduction_axes (`centred(x, mask, axes)`), r shaped like x and var broadcast to it."""
    size = x.shape[-1] // groups
    shape = x.shape[:-1] + (groups, size)
    if mask is not None:
        mask = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape).reshape(shape)
    axes = tuple(reduction_axes[:-1]) + (x.ndim,)  # the grouped input has one more axis
    r, _, var = centred(x.reshape(shape), mask, axes)
    var = jnp.repeat(_expand(var, axes), size, axis=-1)  # [.., groups, size]
    kept = [1 if a in reduction_axes[:-1] else x.shape[a] for a in range(x.ndim)]
    return r.reshape(x.shape), var.reshape(kept)


def _apply(x, r, var, scale, bias, feature_axes, dtype, epsilon):
    """y = r * (rsqrt(var + epsilon) * scale) + bias in Flax's result dtype (var already
    broadcast against r; scale and bias None where unused, else of the feature shape).

    Every rounding fixed (docs/algorithm.md section 14; float32 operands), the formulas
    of the Keras layers: t = RN32(1/sqrt(var + epsilon)); where var is per feature
    (BatchNorm) y = RN32(RN64(r RN32(t scale) + bias)), else (LayerNorm, GroupNorm: t
    per sample or group) y = RN32(RN64(RN32(r t) scale + bias)).  jit, eager and every
    compiler give the same bits, and those of tf_stable_moments' Keras layers.
    """
    feature_shape = [1] * x.ndim
    for a in feature_axes:
        feature_shape[a] = x.shape[a]
    args = [x]
    if scale is not None:
        scale = scale.reshape(feature_shape)
        args.append(scale)
    if bias is not None:
        bias = bias.reshape(feature_shape)
        args.append(bias)
    shared = tuple(var.shape) == tuple(feature_shape)  # per feature: one factor per feature
    y = _output.scale_shift(r, var + epsilon, scale, bias, shared=shared)
    return jnp.asarray(y, _dtypes.canonicalize_dtype(*args, dtype=dtype))


def _moving(average, momentum, value):
    """Flax's momentum * average + (1 - momentum) * value, each rounding fixed
    (RN32(RN64(...)): docs section 14)."""
    return _output.blend(average, momentum, value, 1 - momentum)


def _linen_centred(mdl, x, mask, axes):
    """`_centred` over the module's axis_name, except while initializing (the named axis
    need not exist then, as in Flax)."""
    axis_name = None if mdl.is_initializing() else mdl.axis_name
    return _centred(x, mask, axes, mdl.dtype, axis_name, mdl.axis_index_groups)


def _scale_shift(mdl, x, r, var, feature_axes):
    """`_apply` with the module's parameters (created here: Flax's names, shapes, dtypes)."""
    reduced = [x.shape[a] for a in feature_axes]
    scale = bias = None
    if mdl.use_scale:
        scale = mdl.param("scale", mdl.scale_init, reduced, mdl.param_dtype)
    if mdl.use_bias:
        bias = mdl.param("bias", mdl.bias_init, reduced, mdl.param_dtype)
    return _apply(x, r, var, scale, bias, feature_axes, mdl.dtype, mdl.epsilon)


class BatchNorm(nn.BatchNorm):
    """flax.linen.BatchNorm with correctly rounded batch statistics (module docstring)."""

    @compact
    def __call__(self, x, use_running_average=None, *, mask=None):
        use_running_average = merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        feature_axes = _axes(x.ndim, self.axis)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        feature_shape = [x.shape[a] for a in feature_axes]
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, feature_shape, jnp.float32)
        ra_var = self.variable("batch_stats", "var", jnp.ones, feature_shape, jnp.float32)
        if use_running_average:
            stats_shape = [x.shape[a] if a in feature_axes else 1 for a in range(x.ndim)]
            var = ra_var.value.reshape(stats_shape)
            r = jnp.asarray(x, _work(x, self.dtype)) - ra_mean.value.reshape(stats_shape)
        else:
            r, mean, var = _linen_centred(self, x, mask, reduction_axes)
            if not self.is_initializing():
                ra_mean.value = _moving(ra_mean.value, self.momentum, mean)
                ra_var.value = _moving(ra_var.value, self.momentum, var)
            var = _expand(var, reduction_axes)
        return _scale_shift(self, x, r, var, feature_axes)


class LayerNorm(nn.LayerNorm):
    """flax.linen.LayerNorm with correctly rounded statistics (module docstring)."""

    @compact
    def __call__(self, x, *, mask=None):
        reduction_axes = _axes(x.ndim, self.reduction_axes)
        r, _, var = _linen_centred(self, x, mask, reduction_axes)
        feature_axes = _axes(x.ndim, self.feature_axes)
        return _scale_shift(self, x, r, _expand(var, reduction_axes), feature_axes)


class GroupNorm(nn.GroupNorm):
    """flax.linen.GroupNorm with correctly rounded statistics (module docstring)."""

    @compact
    def __call__(self, x, *, mask=None):
        reduction_axes = _group_axes(x.ndim, self.reduction_axes)
        if (self.num_groups is None) == (self.group_size is None):
            raise ValueError(
                "GroupNorm: give exactly one of num_groups and group_size (to give "
                "group_size, pass num_groups=None: its default is 32); got "
                f"num_groups={self.num_groups!r}, group_size={self.group_size!r}"
            )
        channels = x.shape[-1]
        if self.group_size is not None:
            if channels % self.group_size:
                raise ValueError(
                    f"GroupNorm: the channels ({channels}) are not a multiple of "
                    f"group_size={self.group_size!r}"
                )
            groups = channels // self.group_size
        else:
            groups = self.num_groups
        if groups <= 0 or channels % groups:
            raise ValueError(
                f"GroupNorm: num_groups={groups!r} does not divide the {channels} channels"
            )
        r, var = _grouped(x, mask, reduction_axes, groups, lambda *a: _linen_centred(self, *a))
        return _scale_shift(self, x, r, var, (x.ndim - 1,))
