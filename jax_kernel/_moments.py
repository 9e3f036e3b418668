"""Public JAX wrapper: validate and canonicalise, then call the jitted kernel.

Two kernels with the same results, bit for bit (both correctly rounded):

* the native kernel (moments_core/native/moments.h as an XLA FFI custom call,
  jax_kernel/_native), used on the CPU backend;
* the pure-XLA kernel (moments_core/_kernel.py with jax_kernel/_ops.py), used on
  accelerators, with ``TF_STABLE_MOMENTS_EXACT_ONLY=1`` (the native kernel has no
  exact-only switch), with ``TF_STABLE_MOMENTS_NATIVE=0``, and wherever the native
  library cannot be built or loaded.

The choice is made per lowering platform, in one place (`_stats_p`, a primitive
with a lowering for the CPU and one for every other platform): XLA lowers the
native FFI call only for the CPU (where it is registered), and the XLA kernel for a
GPU or TPU, also in a process whose CPU arrays and GPU arrays meet in one program
(each computation is lowered for the platform of its devices).  Only the chosen
kernel is traced (``lax.platform_dependent`` would trace both: about 0.3-0.6 s of
the XLA kernel per new shape, which the native path exists to avoid).  Whether the
native kernel is allowed at all (``TF_STABLE_MOMENTS_NATIVE``, the library loaded,
the exact-only switch) is a static argument of the jitted functions, so switching
TF_STABLE_MOMENTS_NATIVE between calls takes effect on the next call of `moments`.
"""

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_kernel import _native, _ops
from moments_core import _kernel
from moments_core._formats import FORMATS
from moments_core._validate import canonical_axes, check_ddof, out_shape
from moments_core.native import layout as native_layout

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
    n = math.prod(x.shape[a] for a in axes)
    rest = math.prod(x.shape[a] for a in kept)
    if axes == tuple(range(len(axes))):
        return x.reshape(n, rest), 0
    if axes != tuple(range(ndim - len(axes), ndim)):
        x = jnp.transpose(x, kept + list(axes))
    return x.reshape(rest, n), 1


def _exact_only():
    """Test switch: TF_STABLE_MOMENTS_EXACT_ONLY=1 sends every slice through the exact path."""
    return os.environ.get("TF_STABLE_MOMENTS_EXACT_ONLY", "0") == "1"


def _use_native(exact_only=False):
    """True when the native kernel may serve computations lowered for the CPU (see the
    module docstring): enabled, loaded, and not under the exact-only switch."""
    if exact_only or not _native.enabled():
        return False
    return _native.available()


def _native_moments(x, axes, ddof, lo=False):
    """(means, var, undecided, lows) from the native kernel: means one array per real
    part (float16/bfloat16 data computed in float32 with their own format, cast back
    exactly), all flat over the kept axes in row-major order; undecided int32; lows
    (with lo, else empty) mean_lo per part from the native mean_lo call."""
    data, fmt, work = native_data(x, axes)
    mean, var, count = _native.moments_call(data, ddof, fmt)
    with jax.enable_x64(True):
        count = count.astype(np.int32)
    means = [mean[..., j].reshape(-1).astype(work) for j in range(data.shape[-1])]
    lows = []
    if lo:
        low = _native.mean_lo_call(data, mean, var, ddof, fmt)
        lows = [low[..., j].reshape(-1).astype(work) for j in range(data.shape[-1])]
    return means, var.reshape(-1).astype(work), count, lows


def native_data(x, axes):
    """(data, fmt, work): x as the native calls read it, [outer, n, inner, parts] (moments_core
    .native.layout; float16/bfloat16 as float32, exact), its target format and dtype."""
    work = _compute_dtype(x.dtype)
    carrier = np.dtype(np.float32) if work in _HALF_DTYPES else work
    perm, shape = native_layout(list(x.shape), axes)
    laid = (x if perm is None else jnp.transpose(x, perm)).reshape(shape)
    if jnp.iscomplexobj(laid):
        data = jnp.stack([jnp.real(laid), jnp.imag(laid)], axis=-1).astype(carrier)
    else:
        data = laid.astype(carrier)[..., None]
    return data, FORMATS[work.name], work


def _kernel_parts(x, axes):
    """(parts, axis, fmt, work): x's real parts laid out in 2-D, in their target format."""
    work = _compute_dtype(x.dtype)
    parts = [x] if not jnp.iscomplexobj(x) else [jnp.real(x), jnp.imag(x)]
    laid = [_layout(p.astype(work), axes) for p in parts]
    return [p for p, _ in laid], laid[0][1], FORMATS[work.name], work


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _fast(x, axes, ddof, exact_only, f32=False):
    parts, axis, fmt, _ = _kernel_parts(x, axes)
    with jax.enable_x64(True):
        return _kernel.fast_moments(_ops, parts, axis, ddof, fmt, None, exact_only, None, f32)


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
        f32 = _kernel.f32_pairs(_native.concrete_platform(x))
        means, var, todo, sums = _fast(x, axes, ddof, exact_only, f32)
        if bool(jnp.any(todo)):
            means, var = _exact(x, axes, ddof, todo, means, var, sums)
        means = [m.astype(work) for m in means]
        var = var.astype(work)
    mean = means[0] if len(means) == 1 else lax.complex(means[0], means[1])
    shape = out_shape(x.shape, axes, keepdims)
    return mean.reshape(shape), var.reshape(shape)


def _mean_lo_parts(x, axes, ddof, means, var):
    """mean_lo per real part (moments_core/_kernel.py `mean_lo`, in XLA) from the
    certified means (one per part) and variance, in the target format."""
    parts, axis, fmt, work = _kernel_parts(x, axes)
    with jax.enable_x64(True):
        v64 = var.astype(np.float64)
        # Buffers of their own (`_kernel.mean_lo_round`): the layers use them per element.
        return [
            _kernel.mean_lo(_ops, p, axis, m.astype(np.float64), v64, ddof, fmt).astype(work)
            for p, m in zip(parts, means)
        ]


def _kernel_outputs(x, axes, ddof, lo, exact_only, native, f32=False):
    """The flat outputs of `_stats_p`: means (one per real part), var, the undecided
    count (int32), and with lo mean_lo per part, all flat over the kept axes."""
    if native:
        means, var, count, lows = _native_moments(x, axes, ddof, lo)
    else:  # the step of TensorFlow's XlaCallModule (tf_stable_moments/_xla_module.py)
        parts, axis, fmt, _ = _kernel_parts(x, axes)
        with jax.enable_x64(True):
            *outs, count = _kernel.kernel_outputs(
                _ops, parts, axis, ddof, fmt, None, lo, exact_only, f32
            )
            count = count.astype(np.int32)
        k = len(parts)
        means, var, lows = outs[:k], outs[k], outs[k + 1 :]
    return [*means, var, count, *lows]


# The kernel as a primitive whose lowering depends on the platform it is lowered for: the
# native FFI call (registered for the CPU only) where `native` allows it on the CPU, the
# XLA kernel everywhere else.  Device data never reach the CPU's native kernel.
try:  # public in jax.core up to 0.10 (deprecated there in favour of jax.extend)
    from jax.core import ShapedArray as _ShapedArray
except ImportError:  # pragma: no cover (newer JAX)
    from jax._src.core import ShapedArray as _ShapedArray

_stats_p = Primitive("tf_stable_moments_stats")
_stats_p.multiple_results = True


@_stats_p.def_abstract_eval
def _stats_abstract(x, *, axes, ddof, lo, exact_only, native, x64):
    work = _compute_dtype(x.dtype)
    kept = math.prod(d for a, d in enumerate(x.shape) if a not in axes)  # symbolic dims too
    vector = _ShapedArray((kept,), work)
    k = 2 if jnp.iscomplexobj(x) else 1
    return [vector] * (k + 1) + [_ShapedArray((), np.int32)] + [vector] * (k * lo)


_kernel_outputs_jit = jax.jit(
    _kernel_outputs, static_argnames=("axes", "ddof", "lo", "exact_only", "native", "f32")
)


@_stats_p.def_impl
def _stats_impl(x, *, native, x64, **params):
    """A concrete array (outside jit, or under jax.disable_jit): the kernel of its
    platform, compiled once per variant (op by op under disable_jit)."""
    platform = _native.concrete_platform(x)
    native = native and platform == "cpu"
    with jax.enable_x64(x64):
        return _kernel_outputs_jit(x, native=native, f32=_kernel.f32_pairs(platform), **params)


def _stats_lowering(platform):
    def lower(ctx, x, *, axes, ddof, lo, exact_only, native, x64):
        fn = functools.partial(
            _kernel_outputs_jit,
            axes=axes,
            ddof=ddof,
            lo=lo,
            exact_only=exact_only,
            native=native and platform == "cpu" and not _native.for_export(ctx),
            f32=_kernel.f32_pairs(platform),
        )
        # Traced with the 64-bit mode of the bind (a caller's enable_x64 has ended when
        # XLA lowers), so that the outputs have the dtypes of `_stats_abstract`.  Through
        # the jitted kernel: call sites of one shape share its trace (jit's cache) and its
        # lowering (one function of the module, called from each): a ResNet50's
        # conversion to MLIR under Keras-JAX `jit`, CPU twin, 1.82 s -> 1.41 s.
        with jax.enable_x64(x64):
            return mlir.lower_fun(fn, multiple_results=True)(ctx, x)

    return lower


mlir.register_lowering(_stats_p, _stats_lowering(None))  # GPUs: float64 sums
for _platform in ("cpu", "tpu"):
    mlir.register_lowering(_stats_p, _stats_lowering(_platform), platform=_platform)


def _stats_batch(args, dims, *, axes, **params):
    """vmap: the batch axis becomes the first kept axis (outputs flat over the kept axes in
    row-major order, so [batch * kept] reshapes to [batch, kept]); the undecided count is
    that of all batch elements together."""
    (x,), (bd,) = args, dims
    x = jnp.moveaxis(x, bd, 0)
    outs = _stats_p.bind(x, axes=tuple(a + 1 for a in axes), **params)
    b = x.shape[0]
    out = [o.reshape(b, -1) if o.ndim else o for o in outs]
    return out, [0 if o.ndim else None for o in out]


batching.primitive_batchers[_stats_p] = _stats_batch


def stats(x, axes, ddof, lo=True, exact_only=False, undecided=False, native=None):
    """(mean, mean_lo, var) in the target format, shaped like the kept axes.

    mean and var are correctly rounded (moments_core/_kernel.py, with 64-bit
    types enabled for the kernel only; on the CPU backend the native kernel,
    with the same bits); mean_lo (None unless lo) is mean(x) - mean from a
    deterministic fixed-point sum (the native mean_lo call with the native kernel, else
    in XLA: the same bits).  With undecided=True,
    also the number of slices the fast path left to the exact path (that of the
    kernel used).  native: use the native kernel (True), the XLA one (False), or
    decide now (None: `_use_native`).
    """
    native = _use_native(exact_only) if native is None else bool(native) and not exact_only
    k = 2 if jnp.iscomplexobj(x) else 1
    outs = _stats_p.bind(
        x,
        axes=tuple(axes),
        ddof=ddof,
        lo=bool(lo),
        exact_only=bool(exact_only),
        native=native,
        x64=bool(jax.config.jax_enable_x64),
    )
    means, var, count, lows = outs[:k], outs[k], outs[k + 1], outs[k + 2 :]
    shape = out_shape(x.shape, axes, False)
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
    native = _use_native(_exact_only())
    count = jax.jit(stats, static_argnums=(1, 2, 3, 4, 5, 6))(
        x, axes, ddof, False, _exact_only(), True, native
    )[3]
    kept = int(np.prod([x.shape[a] for a in range(x.ndim) if a not in axes]))
    return int(count) / max(kept, 1)


def residuals(x, mean_hi, mean_lo, axes):
    """x - mean from the mean's two parts, differentiable as x - mean(x)."""
    # Zero in value (no overflow near the float maximum), mean(dx) in derivative.
    linear = jnp.mean(x - lax.stop_gradient(x), axis=axes, keepdims=True)
    return ((x - lax.stop_gradient(mean_hi)) - lax.stop_gradient(mean_lo)) - linear


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4))
def _moments_real(x, axes, ddof, exact_only, native):
    mh, _, var = stats(x, axes, ddof, False, exact_only, native=native)
    return mh, var


@_moments_real.defjvp
def _moments_real_jvp(axes, ddof, exact_only, native, primals, tangents):
    (x,), (dx,) = primals, tangents
    # The primal outputs through the custom_jvp function itself: derivatives of any
    # order never differentiate the kernel (the native FFI call has no derivative).
    mh, var = _moments_real(x, axes, ddof, exact_only, native)
    xs, mhs, vs = lax.stop_gradient(x), lax.stop_gradient(mh), lax.stop_gradient(var)
    ml = _mean_lo_parts(xs, axes, ddof, [mhs.reshape(-1)], vs.reshape(-1))[0].reshape(mh.shape)
    n = math.prod(x.shape[a] for a in axes)
    r = residuals(x, jnp.expand_dims(mh, axes), jnp.expand_dims(ml, axes), axes)
    # A slice with NaN or Inf gets a zero variance gradient: its NaN residuals must
    # not reach other slices through the transposed product (0 * NaN).
    r = jnp.where(jnp.expand_dims(jnp.isfinite(var), axes), r, jnp.zeros_like(r))
    dmean = jnp.sum(dx, axis=axes) / n
    dvar = 2 * jnp.sum(r * dx, axis=axes) / (n - ddof)
    return (mh, var), (dmean.astype(mh.dtype), dvar.astype(var.dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _moments(x, axes, keepdims, ddof, exact_only, native=False):
    if jnp.iscomplexobj(x):
        mean, _, var = stats(x, axes, ddof, False, exact_only, native=native)
    else:
        mean, var = _moments_real(x, axes, ddof, exact_only, native)
    shape = out_shape(x.shape, axes, keepdims)
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
    exact_only = _exact_only()
    native = _use_native(exact_only)
    concrete = not isinstance(x, jax.core.Tracer)
    if concrete and not (native and _native.concrete_platform(x) == "cpu"):
        return _concrete_moments(x, axes, bool(keepdims), ddof, exact_only)
    return _moments(x, axes, bool(keepdims), ddof, exact_only, native)
