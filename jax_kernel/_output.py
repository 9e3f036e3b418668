"""The layers' output formulas (moments_core/_affine.py) in JAX, differentiable.

Used by the Keras layers on the JAX backend and by the Flax layers.  float32 operands
take the formulas whose bits no compiler can change (docs/algorithm.md section 14);
other dtypes (float64 statistics) the plain expressions.  Derivatives (custom_jvp,
so that jvp, grad and their compositions all work) are those of the plain
expressions, evaluated in float32: d(1/sqrt v) = -t**3 / 2 dv, d(a b) = b da + a db,
d(r f + b) = f dr + r df + db.  `div` and `blend` (renorm's corrections, moving
averages, the masked variance: quantities the layers use as constants) have none.
"""

import jax
import jax.numpy as jnp
from jax import lax

from jax_kernel import _ops
from moments_core import _affine


def _certified(*arrays):
    return all(a is None or jnp.result_type(a) == jnp.float32 for a in arrays)


def _x64(fn):
    """fn(_ops, *args) with 64-bit types enabled (jax_kernel/_ops.py's condition)."""

    def run(*args):
        with jax.enable_x64(True):
            return fn(_ops, *args)

    return run


_rsqrt32 = jax.custom_jvp(_x64(_affine.rsqrt32))
_times32 = jax.custom_jvp(_x64(_affine.times32))
_affine32 = jax.custom_jvp(_x64(_affine.affine32))


@_rsqrt32.defjvp
def _rsqrt32_jvp(primals, tangents):
    # the tangent from the plain expression: a few operations that XLA may fuse anywhere
    # (the certified t's 60 would be recomputed per element where it is used per element)
    t = 1.0 / jnp.sqrt(primals[0])
    return _rsqrt32(primals[0]), (-0.5 * t * t * t) * tangents[0]


@_times32.defjvp
def _times32_jvp(primals, tangents):
    (a, b), (da, db) = primals, tangents
    return _times32(a, b), da * b + a * db


@_affine32.defjvp
def _affine32_jvp(primals, tangents):
    (r, f, b), (dr, df, db) = primals, tangents
    return _affine32(r, f, b), dr * f + r * df + db


def rsqrt(v):
    """1 / sqrt(v): RN32(v**-0.5) for float32 v (the same bits everywhere)."""
    return _rsqrt32(v) if _certified(v) else 1.0 / jnp.sqrt(v)


def div(a, s):
    """a / s: RN32(a / s) for float32 a and s; no derivative."""
    a, s = lax.stop_gradient(jnp.asarray(a)), lax.stop_gradient(jnp.asarray(s))
    if not _certified(a, s):
        return a / s
    return _ops.materialize(_x64(_affine.div32)(a, s))  # per slice: not per element


def recip(s):
    """1 / s: RN32(1 / s) for float32 s; no derivative."""
    return div(jnp.ones_like(s), s)


def times(a, b):
    """a * b: RN32(a * b) through float64 for float32 a and b: a chain of products
    is not reordered."""
    return _times32(a, b) if _certified(a, b) else a * b


def affine(r, f, b=None):
    """r * f + b: RN32(RN64(r * f + b)) for float32 operands; b None: `times`."""
    if b is None:
        return times(r, f)
    return _affine32(r, f, b) if _certified(r, f, b) else r * f + b


def blend(a, wa, b, wb):
    """a * wa + b * wb: RN32(RN64(a wa + b wb)) for float32 operands; no derivative."""
    a, b = lax.stop_gradient(jnp.asarray(a)), lax.stop_gradient(jnp.asarray(b))
    wa, wb = (jnp.asarray(w, a.dtype) for w in (wa, wb))
    if _certified(a, wa, b, wb):
        return _x64(_affine.blend32)(a, wa, b, wb)
    return a * wa + b * wb


def scale_shift(r, v, gamma=None, beta=None, shared=False):
    """A layer's output from r, v = var + eps (per slice, broadcast against r), gamma and
    beta (`moments_core._affine.scale_shift32`, docs section 14); shared: gamma has t's
    shape (BatchNorm), else gamma is per feature (LayerNorm, GroupNorm)."""
    if not _certified(r, v, gamma, beta):
        scale = 1.0 / jnp.sqrt(v) if gamma is None else gamma / jnp.sqrt(v)
        return r * scale if beta is None else r * scale + beta
    # Per-slice values as buffers of their own (_ops.materialize): XLA would otherwise
    # fuse their chains into the per-element pass, once per element.
    t = _ops.materialize(rsqrt(v))
    if gamma is None:
        return affine(r, t, beta)
    if shared:
        return affine(r, _ops.materialize(times(gamma, t)), beta)
    return affine(times(r, t), gamma, beta)
