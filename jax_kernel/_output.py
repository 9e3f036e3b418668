"""The layers' output formulas (moments_core/_affine.py) in JAX, differentiable.

Used by the Keras layers on the JAX backend and by the Flax layers.  float32 and float64
operands take the formulas whose bits no compiler can change (docs/algorithm.md section
14); other dtypes and mixed operands the plain expressions.  float32 `rsqrt` is one
native FFI call in computations lowered for the CPU (the same bits), the XLA formula
elsewhere and in exported artifacts.  Derivatives (custom_jvp,
so that jvp, grad and their compositions all work) are those of the plain
expressions, in the operands' dtype: d(1/sqrt v) = -t**3 / 2 dv, d(a b) = b da + a db,
d(r f + b) = f dr + r df + db.  `div` and `blend` (renorm's corrections, moving
averages, the masked variance: quantities the layers use as constants) have none.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_kernel import _native, _ops
from moments_core import _affine


def _kind(*arrays):
    """32 (float32 operands), 64 (float64 operands) or None (mixed or other dtypes: the
    plain expressions)."""
    kinds = {jnp.result_type(a) for a in arrays if a is not None}
    if len(kinds) != 1:
        return None
    return {jnp.dtype(jnp.float32): 32, jnp.dtype(jnp.float64): 64}.get(kinds.pop())


def _x64(fn):
    """fn(_ops, *args) with 64-bit types enabled (jax_kernel/_ops.py's condition), as a
    jitted function: traced once per shape and dtype, so that the layers of a model that
    share a shape share one trace (a BN layer's formulas are some 100 operations; traced
    under a training step's linearize each cost about 0.2 ms of Python: 2.4 s of a
    ResNet50's first step, 106 traces).  XLA inlines the call: the same HLO."""

    def run(*args):
        with jax.enable_x64(True):
            return fn(_ops, *args)

    run.__name__ = run.__qualname__ = fn.__name__
    return jax.jit(run)


def _rsqrt32_xla(v):
    with jax.enable_x64(True):
        return _affine.rsqrt32(_ops, v)


# float32 rsqrt32 as a primitive lowered per platform (as `jax_kernel._moments._stats_p`
# chooses the kernel): on the CPU with the native library one FFI call (moments.h
# `rsqrt32`, the same bits), which XLA does not compile (as some 60 operations per layer
# it was about 0.6 s of a ResNet50's first jit step); elsewhere, and in an exported
# artifact, the XLA operations.  `native` (static) says whether the library may serve.
_rsqrt32_p = Primitive("tf_stable_moments_rsqrt32")
_rsqrt32_p.def_abstract_eval(lambda v, **_: v)


@_rsqrt32_p.def_impl
def _rsqrt32_impl(v, *, native):
    """Concrete arrays (eager, or under jax.disable_jit)."""
    if native and _native.concrete_platform(v) == "cpu":
        return _native.rsqrt_call(v)
    return jax.jit(_rsqrt32_xla)(v)


def _rsqrt32_lowering(platform):
    def lower(ctx, v, *, native):
        native = native and platform == "cpu" and not _native.for_export(ctx)
        fn = _native.rsqrt_call if native else _rsqrt32_xla
        return mlir.lower_fun(fn, multiple_results=False)(ctx, v)

    return lower


mlir.register_lowering(_rsqrt32_p, _rsqrt32_lowering(None))
mlir.register_lowering(_rsqrt32_p, _rsqrt32_lowering("cpu"), platform="cpu")
batching.primitive_batchers[_rsqrt32_p] = lambda args, dims, **params: (
    _rsqrt32_p.bind(*args, **params),
    dims[0],
)  # elementwise


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _rsqrt32(v, native):
    return _rsqrt32_p.bind(v, native=native)


def _rsqrt_tangent(v, dv):
    """d(1/sqrt v) = -t**3 / 2 dv with t from the plain expression: a few operations that
    XLA may fuse anywhere (the certified t's 60 would be recomputed per element where
    the tangent is used per element)."""
    t = 1.0 / jnp.sqrt(v)
    return (-0.5 * t * t * t) * dv


@_rsqrt32.defjvp
def _rsqrt32_jvp(native, primals, tangents):
    return _rsqrt32(primals[0], native), _rsqrt_tangent(primals[0], tangents[0])


def _differentiable(times_fn, affine_fn):
    """(times, affine) of one kind with the plain expressions' derivatives."""
    times_, affine_ = (jax.custom_jvp(_x64(f)) for f in (times_fn, affine_fn))

    @times_.defjvp
    def _times_jvp(primals, tangents):
        (a, b), (da, db) = primals, tangents
        return times_(a, b), da * b + a * db

    @affine_.defjvp
    def _affine_jvp(primals, tangents):
        (r, f, b), (dr, df, db) = primals, tangents
        return affine_(r, f, b), dr * f + r * df + db

    return times_, affine_


_RSQRT64 = jax.custom_jvp(_x64(_affine.rsqrt64))


@_RSQRT64.defjvp
def _rsqrt64_jvp(primals, tangents):
    return _RSQRT64(primals[0]), _rsqrt_tangent(primals[0], tangents[0])


_TIMES, _AFFINE = (
    dict(zip((32, 64), fns))
    for fns in zip(
        _differentiable(_affine.times32, _affine.affine32),
        _differentiable(_affine.times64, _affine.affine64),
    )
)
_DIV = {32: _x64(_affine.div32), 64: _x64(_affine.div64)}
_BLEND = {32: _x64(_affine.blend32), 64: _x64(_affine.blend64)}


def _native_allowed():
    """Whether computations lowered for the CPU may call the native library now
    (TF_STABLE_MOMENTS_NATIVE, the library loaded): a static argument of the jitted
    functions, so that switching it takes effect on the next call."""
    return _native.available()


def _rsqrt(v, native):
    kind = _kind(v)
    if kind == 32:
        return _rsqrt32(v, native)
    return _RSQRT64(v) if kind == 64 else 1.0 / jnp.sqrt(v)


def rsqrt(v):
    """1 / sqrt(v): RN(v**-0.5) for float32 and float64 v (the same bits everywhere)."""
    return _rsqrt(v, _native_allowed())


def div(a, s):
    """a / s: RN(a / s) for float32 or float64 a and s; no derivative."""
    a, s = lax.stop_gradient(jnp.asarray(a)), lax.stop_gradient(jnp.asarray(s))
    kind = _kind(a, s)
    if not kind:
        return a / s
    return _ops.materialize(_DIV[kind](a, s))  # per slice: not per element


def recip(s):
    """1 / s: RN(1 / s) for float32 or float64 s; no derivative."""
    return div(jnp.ones_like(s), s)


def times(a, b):
    """a * b: RN32(a * b) through float64 for float32 a and b (a chain of products is
    not reordered), RN64(a * b) for float64 (`_affine.times64`)."""
    kind = _kind(a, b)
    return _TIMES[kind](a, b) if kind else a * b


def affine(r, f, b=None):
    """r * f + b: RN32(RN64(r * f + b)) for float32 operands, `_affine.affine64` for
    float64; b None: `times`."""
    if b is None:
        return times(r, f)
    kind = _kind(r, f, b)
    return _AFFINE[kind](r, f, b) if kind else r * f + b


def blend(a, wa, b, wb):
    """a * wa + b * wb: RN32(RN64(a wa + b wb)) for float32 operands, `_affine.blend64`
    for float64; no derivative."""
    a, b = lax.stop_gradient(jnp.asarray(a)), lax.stop_gradient(jnp.asarray(b))
    wa, wb = (jnp.asarray(w, a.dtype) for w in (wa, wb))
    kind = _kind(a, wa, b, wb)
    if kind:
        return _BLEND[kind](a, wa, b, wb)
    return a * wa + b * wb


def scale_shift(r, v, gamma=None, beta=None, shared=False):
    """A layer's output from r, v = var + eps (per slice, broadcast against r), gamma and
    beta (`moments_core._affine.scale_shift32`, `scale_shift64`, docs section 14); shared:
    gamma has t's shape (BatchNorm), else gamma is per feature (LayerNorm, GroupNorm)."""
    if not _kind(r, v, gamma, beta):
        scale = 1.0 / jnp.sqrt(v) if gamma is None else gamma / jnp.sqrt(v)
        return r * scale if beta is None else r * scale + beta
    return _scale_shift(r, v, gamma, beta, bool(shared), _native_allowed())


@functools.partial(jax.jit, static_argnums=(4, 5))
def _scale_shift(r, v, gamma, beta, shared, native):
    """`scale_shift` of float32 or float64 operands, jitted: the layers of a model that
    share a shape share its trace and the trace of its derivative (under a training
    step's linearize each of its operations costs Python time, per layer).  One
    custom_jvp for the whole formula rather than one per step (the same derivatives, bit
    for bit): a ResNet50's first JAX jit step 1.11-1.26x -> 0.94-1.14x keras's."""
    return _scale_shift_jvp(r, v, gamma, beta, shared, native)


def _scale_shift_values(r, v, gamma, beta, shared, native):
    """(y, t, u): the output, t = rsqrt(v) and u = times(gamma, t) (shared) or times(r, t)
    (gamma per feature; else None) by the certified formulas, each differentiable
    (their derivatives serve the tangent rule's own: second order)."""
    kind = _kind(r, v, gamma, beta)
    times_, affine_ = _TIMES[kind], _AFFINE[kind]
    # Per-slice values as buffers of their own (_ops.materialize): XLA would otherwise
    # fuse their chains into the per-element pass, once per element.
    t = _ops.materialize(_rsqrt(v, native))
    if gamma is None:
        return (times_(r, t) if beta is None else affine_(r, t, beta)), t, None
    if shared:
        f = _ops.materialize(times_(gamma, t))
        return (times_(r, f) if beta is None else affine_(r, f, beta)), t, f
    rt = times_(r, t)
    return (times_(rt, gamma) if beta is None else affine_(rt, gamma, beta)), t, rt


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5))
def _scale_shift_jvp(r, v, gamma, beta, shared, native):
    return _scale_shift_values(r, v, gamma, beta, shared, native)[0]


@_scale_shift_jvp.defjvp
def _scale_shift_tangent(shared, native, primals, tangents):
    """The plain expressions' derivatives, step by step as the formulas compose:
    d(1/sqrt v) = -t**3 / 2 dv (t by the plain expression), d(a b) = b da + a db,
    d(r f + b) = f dr + r df + db, with the certified values where the formulas use them."""
    r, v, gamma, beta = primals
    dr, dv, dgamma, dbeta = tangents
    y, t, u = _scale_shift_values(r, v, gamma, beta, shared, native)
    dt = _rsqrt_tangent(v, dv)

    def d_affine(a, da, c, dc, db):  # d(a c + b)
        out = da * c + a * dc
        return out if db is None else out + db

    if gamma is None:
        return y, d_affine(r, dr, t, dt, dbeta)
    if shared:  # u = f = gamma t
        return y, d_affine(r, dr, u, dgamma * t + gamma * dt, dbeta)
    return y, d_affine(u, dr * t + r * dt, gamma, dgamma, dbeta)  # u = r t
