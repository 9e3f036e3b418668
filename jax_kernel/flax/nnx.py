"""flax.nnx BatchNorm, LayerNorm and GroupNorm with correctly rounded statistics.

The nnx counterparts of `jax_kernel.flax.linen` (whose docstring describes the
arithmetic): each class subclasses Flax's, so its constructor (``num_features``,
``rngs``, ...), attributes (``scale``, ``bias``: ``nnx.Param``; ``mean``, ``var``:
``nnx.BatchStat``), ``nnx.view`` and checkpoints are Flax's; only ``__call__``
differs.  ``axis_name`` and ``axis_index_groups`` give the statistics of every
device's batch on that axis (the certified merge of docs/algorithm.md section 13b:
one all-reduce of fast sums and bounds, exact states only for slices it leaves open).

    from jax_kernel.flax import nnx as stable
    norm = stable.BatchNorm(16, use_running_average=False, rngs=nnx.Rngs(0))
"""

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.module import first_from

from jax_kernel._centre import expand as _expand
from jax_kernel.flax.linen import (
    _apply,
    _axes,
    _centred,
    _group_axes,
    _grouped,
    _moving,
    _work,
)

__all__ = ["BatchNorm", "GroupNorm", "LayerNorm"]


def _nnx_centred(module, x, mask, axes):
    return _centred(x, mask, axes, module.dtype, module.axis_name, module.axis_index_groups)


def _params(module):
    scale = module.scale[...] if module.scale is not None else None
    bias = module.bias[...] if module.bias is not None else None
    return scale, bias


class BatchNorm(nnx.BatchNorm):
    """flax.nnx.BatchNorm with correctly rounded batch statistics (module docstring)."""

    def __call__(self, x, use_running_average=None, *, mask=None):
        use_running_average = first_from(
            use_running_average,
            self.use_running_average,
            error_msg=(
                "BatchNorm: no use_running_average was given, to the constructor or the "
                "call; got use_running_average=None for both"
            ),
        )
        feature_axes = _axes(x.ndim, self.axis)
        reduction_axes = tuple(i for i in range(x.ndim) if i not in feature_axes)
        scale, bias = _params(self)
        x, mean, var, scale, bias = self.promote_dtype(
            (x, self.mean[...], self.var[...], scale, bias), dtype=self.dtype
        )
        stats_shape = [x.shape[a] if a in feature_axes else 1 for a in range(x.ndim)]
        if use_running_average:
            r = jnp.asarray(x, _work(x, self.dtype)) - mean.reshape(stats_shape)
            var = var.reshape(stats_shape)
        else:
            r, batch_mean, batch_var = _nnx_centred(self, x, mask, reduction_axes)
            stop = jax.lax.stop_gradient
            self.mean[...] = stop(_moving(self.mean[...], self.momentum, batch_mean))
            self.var[...] = stop(_moving(self.var[...], self.momentum, batch_var))
            var = _expand(batch_var, reduction_axes)
        return _apply(x, r, var, scale, bias, feature_axes, self.dtype, self.epsilon)


class LayerNorm(nnx.LayerNorm):
    """flax.nnx.LayerNorm with correctly rounded statistics (module docstring)."""

    def __call__(self, x, *, mask=None):
        scale, bias = _params(self)
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        reduction_axes = _axes(x.ndim, self.reduction_axes)
        r, _, var = _nnx_centred(self, x, mask, reduction_axes)
        feature_axes = _axes(x.ndim, self.feature_axes)
        var = _expand(var, reduction_axes)
        return _apply(x, r, var, scale, bias, feature_axes, self.dtype, self.epsilon)


class GroupNorm(nnx.GroupNorm):
    """flax.nnx.GroupNorm with correctly rounded statistics (module docstring)."""

    def __call__(self, x, *, mask=None):
        reduction_axes = _group_axes(x.ndim, self.reduction_axes)
        scale, bias = _params(self)
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        r, var = _grouped(
            x, mask, reduction_axes, self.num_groups, lambda *a: _nnx_centred(self, *a)
        )
        return _apply(x, r, var, scale, bias, (x.ndim - 1,), self.dtype, self.epsilon)
