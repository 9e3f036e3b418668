"""The native kernel (moments_core/native/moments.h) as an XLA FFI custom call on CPU.

The library ``_stable_moments_ffi.so`` next to this file is built at install time
(setup.py); where it is missing, it is built once at first use into a per-user cache
directory (``moments_core.native.build.cache_dir``), one per jaxlib version and source.
It is loaded with ctypes and its handler registered with XLA for the CPU platform,
once per process.  If it cannot be built or loaded, `load` warns once and returns
None, and the callers keep the pure-XLA kernel.  ``TF_STABLE_MOMENTS_NATIVE=0``
disables the native kernel (no warning).
"""

import ctypes
import os
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from moments_core.native import enabled

HERE = os.path.dirname(os.path.abspath(__file__))
LIBRARY = os.path.join(HERE, "_stable_moments_ffi.so")
TARGET = "tf_stable_moments_native_moments"  # the FFI target name
SYMBOL = "StableMoments"  # XLA_FFI_DEFINE_HANDLER_SYMBOL in stable_moments_ffi.cc
LO_TARGET, LO_SYMBOL = "tf_stable_moments_native_mean_lo", "StableMeanLo"
STALL_TARGET, STALL_SYMBOL = "tf_stable_moments_native_stall_check", "StableStallCheck"
STATE_TARGET, STATE_SYMBOL = "tf_stable_moments_native_state", "StableState"
FINISH_TARGET, FINISH_SYMBOL = "tf_stable_moments_native_state_moments", "StableStateMoments"
RSQRT_TARGET, RSQRT_SYMBOL = "tf_stable_moments_native_rsqrt", "StableRsqrt"

_LOCK = threading.Lock()
_STATE = {"tried": False, "lib": None, "error": None}

# The stall check's reporter: the library calls it (from an XLA thread; ctypes takes the
# GIL) the first time a channel of a layer stalls; it hands the vectors to the Python
# function set with `set_stall_reporter`.
_FLOATS = ctypes.POINTER(ctypes.c_float)
_REPORTER = ctypes.CFUNCTYPE(None, ctypes.c_int64, _FLOATS, _FLOATS, _FLOATS, ctypes.c_int64)
_REPORT = {"fn": None}


@_REPORTER
def _reporter(token, moving, mean, var, n):
    fn = _REPORT["fn"]
    if fn is not None:
        fn(int(token), *(np.ctypeslib.as_array(p, (int(n),)).copy() for p in (moving, mean, var)))


def set_stall_reporter(fn):
    """fn(token, moving_mean, mean, variance) (numpy float32 vectors) is called the first
    time `stall_call` finds a stalled channel for `token`."""
    _REPORT["fn"] = fn


def _build_in_cache():
    """The library built into the cache directory (once); (path, None) or (None, reason)."""
    import jaxlib

    from moments_core.native import build

    return build.cached_library(
        "jax", jaxlib.__version__, build.JAX_SOURCE, os.path.basename(LIBRARY)
    )


def _open(path):
    lib = ctypes.CDLL(path)
    handlers = [
        (TARGET, getattr(lib, SYMBOL)),
        (LO_TARGET, getattr(lib, LO_SYMBOL)),
        (STALL_TARGET, getattr(lib, STALL_SYMBOL)),
        (STATE_TARGET, getattr(lib, STATE_SYMBOL)),
        (FINISH_TARGET, getattr(lib, FINISH_SYMBOL)),
        (RSQRT_TARGET, getattr(lib, RSQRT_SYMBOL)),
    ]
    lib.SetStallReporter.argtypes = [_REPORTER]
    lib.SetStallReporter.restype = None
    lib.SetStallReporter(_reporter)
    for target, handler in handlers:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return lib


def _load_once():
    errors = []
    if os.path.exists(LIBRARY):
        try:
            return _open(LIBRARY), None
        except (OSError, AttributeError) as e:  # a stale or foreign build: rebuild it
            errors.append(f"{LIBRARY}: {e}")
    path, err = _build_in_cache()
    if path is None:
        errors.append(err)
        return None, "; ".join(errors)
    try:
        return _open(path), None
    except Exception as e:  # noqa: BLE001 - any failure means: use the XLA kernel
        errors.append(f"{path}: {e}")
        return None, "; ".join(errors)


def load():
    """The loaded library with its FFI target registered, or None (XLA kernel).

    Thread-safe; builds or loads at most once per process.  None without a
    warning when TF_STABLE_MOMENTS_NATIVE=0; with one warning (the first time)
    when the library cannot be built or loaded.
    """
    if not enabled():
        return None
    if _STATE["tried"]:
        return _STATE["lib"]
    with _LOCK:
        if not _STATE["tried"]:
            try:
                lib, err = _load_once()
            except Exception as e:  # noqa: BLE001
                lib, err = None, f"{type(e).__name__}: {e}"
            _STATE["lib"], _STATE["error"] = lib, err
            _STATE["tried"] = True
            if lib is None:
                warnings.warn(
                    "jax_kernel: the native CPU moments kernel is unavailable "
                    f"({err}); using the XLA kernel (same results, slower). "
                    "Set TF_STABLE_MOMENTS_NATIVE=0 to silence this warning.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    return _STATE["lib"]


def available():
    """True when the native kernel is enabled and loaded (building it if needed)."""
    return load() is not None


def _format_attrs(fmt):
    """The FFI attributes of the target format (moments_core._formats.Format)."""
    return {name: np.int64(getattr(fmt, name)) for name in ("precision", "emin", "emax")}


def moments_call(x, ddof, fmt):
    """The FFI call on x [..., n, inner, parts] (float32 or float64, parts 1 or 2).

    fmt: the target format (moments_core._formats.Format); float16 and bfloat16
    data come as float32 and their results are exact values of fmt.  Every
    dimension before the last three is a batch of slices.  Returns (mean
    [..., inner, parts], var [..., inner], undecided int64 []): the number of
    slices the rounding test left to the exact path (under vmap, one per batch
    element).  Works under jit, vmap and eagerly.
    """
    if load() is None:
        raise RuntimeError("moments_call: the native kernel is unavailable or switched off")
    if x.ndim < 3 or x.shape[-1] not in (1, 2):
        raise ValueError(f"moments_call: x must be [..., n, inner, parts]; got {x.shape}")
    dtype = np.dtype(x.dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"moments_call: x must be float32 or float64; got {dtype.name}")
    lead, inner = tuple(x.shape[:-3]), tuple(x.shape[-2:])
    with jax.enable_x64(True):
        out = (
            jax.ShapeDtypeStruct(lead + inner, dtype),
            jax.ShapeDtypeStruct(lead + inner[:1], dtype),
            jax.ShapeDtypeStruct((), np.int64),
        )
        call = jax.ffi.ffi_call(TARGET, out, vmap_method="broadcast_all")
        return call(
            x,
            ddof=np.int64(ddof),
            **_format_attrs(fmt),
        )


def mean_lo_call(x, mean, var, ddof, fmt):
    """mean_lo (docs section 9) of the FFI call on x [..., n, inner, parts] from the mean
    [..., inner, parts] and var [..., inner] that `moments_call` returned for it: like mean."""
    if load() is None:
        raise RuntimeError("mean_lo_call: the native kernel is unavailable or switched off")
    with jax.enable_x64(True):
        call = jax.ffi.ffi_call(
            LO_TARGET, jax.ShapeDtypeStruct(mean.shape, mean.dtype), vmap_method="broadcast_all"
        )
        return call(
            x,
            mean,
            var,
            ddof=np.int64(ddof),
            **_format_attrs(fmt),
        )


def state_call(x, fmt, l1, l2):
    """The moments state (docs section 13) of every slice of x [..., n, inner, parts]
    (float32 or float64; float16/bfloat16 data as float32 with their own format `fmt`):
    int32 [..., inner, 3 + parts (l1 + 9) + l2], the digits of `_state.Layout(fmt,
    parts)` with l1, l2 its field lengths."""
    if load() is None:
        raise RuntimeError("state_call: the native kernel is unavailable or switched off")
    size = 3 + x.shape[-1] * (l1 + 9) + l2
    with jax.enable_x64(True):
        out = jax.ShapeDtypeStruct((*x.shape[:-3], x.shape[-2], size), np.int32)
        call = jax.ffi.ffi_call(STATE_TARGET, out, vmap_method="broadcast_all")
        return call(
            x,
            **_format_attrs(fmt),
            l1=np.int64(l1),
            l2=np.int64(l2),
        )


def state_moments_call(values, ddof, fmt, parts, l1, l2, carrier):
    """(mean [..., parts], var [...]) of `carrier` (float32 or float64: values of `fmt`) from
    states values int32 [..., 3 + parts (l1 + 9) + l2] (`_state.Layout`): the bits of
    `state_moments`."""
    if load() is None:
        raise RuntimeError("state_moments_call: the native kernel is unavailable or switched off")
    kept = tuple(values.shape[:-1])
    with jax.enable_x64(True):
        out = (
            jax.ShapeDtypeStruct((*kept, parts), carrier),
            jax.ShapeDtypeStruct(kept, carrier),
        )
        call = jax.ffi.ffi_call(FINISH_TARGET, out, vmap_method="broadcast_all")
        return call(
            values,
            ddof=np.int64(ddof),
            **_format_attrs(fmt),
            l1=np.int64(l1),
            l2=np.int64(l2),
        )


def rsqrt_call(v):
    """RN32(1 / sqrt(v)) of every element of float32 v (moments.h `rsqrt32`, the bits of
    `moments_core._affine.rsqrt32`) as one FFI call (CPU only): the per-channel factor of
    the layers' output formulas (`jax_kernel._output`, docs section 14)."""
    if load() is None:
        raise RuntimeError("rsqrt_call: the native kernel is unavailable or switched off")
    call = jax.ffi.ffi_call(
        RSQRT_TARGET, jax.ShapeDtypeStruct(v.shape, v.dtype), vmap_method="expand_dims"
    )
    return call(v)


def for_export(ctx):
    """Whether a lowering is for `jax.export` (and so jax2tf, Keras-JAX `model.export`):
    an artifact must hold only standard operations, which load without this package
    (JAX refuses to serialise custom calls without a compatibility guarantee)."""
    return bool(getattr(ctx.module_context.lowering_parameters, "for_export", False))


def concrete_platform(x):
    """The platform of a concrete array's devices ("cpu", "gpu", "tpu"): what the
    primitives lowered per platform (`_stall_p`, `jax_kernel._moments._stats_p`) run on
    outside jit."""
    devices = getattr(x, "devices", None)
    return next(iter(devices())).platform if devices else jax.default_backend()


def _stall_ffi(moving_mean, mean, variance, *, momentum, epsilon, threshold, token):
    """The FFI call itself (CPU only)."""
    with jax.enable_x64(True):
        call = jax.ffi.ffi_call(
            STALL_TARGET,
            jax.ShapeDtypeStruct(moving_mean.shape, moving_mean.dtype),
            vmap_method="broadcast_all",
        )
        return call(
            moving_mean,
            mean,
            variance,
            momentum=np.float32(momentum),
            epsilon=np.float32(epsilon),
            threshold=np.float32(threshold),
            token=np.int64(token),
        )


# The check as a primitive lowered per platform: the FFI call for the CPU (where it is
# registered), moving_mean itself for every other platform (a check on the host would
# synchronise device and host at every step), as `jax_kernel._moments._stats_p` chooses
# the kernel.  Named as the target, so that a jaxpr shows the check.
_stall_p = Primitive(STALL_TARGET)
_stall_p.def_abstract_eval(lambda moving_mean, *_, **__: moving_mean)


@_stall_p.def_impl
def _stall_impl(moving_mean, mean, variance, **params):
    """Concrete arrays (eager, or under jax.disable_jit): the check on the CPU only."""
    if concrete_platform(moving_mean) != "cpu":
        return moving_mean
    return _stall_ffi(moving_mean, mean, variance, **params)


def _stall_cpu(ctx, *args, **params):
    """The CPU's lowering: the FFI call, except in an exported artifact (pass-through)."""
    fn = (lambda m, *_, **__: m) if for_export(ctx) else _stall_ffi
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args, **params)


mlir.register_lowering(_stall_p, mlir.lower_fun(lambda m, *_, **__: m, multiple_results=False))
mlir.register_lowering(_stall_p, _stall_cpu, platform="cpu")


def _stall_batch(args, dims, **params):
    """vmap: every input with the batch axis first (broadcast where it has none), as the
    FFI call's broadcast_all; the check reads all channels of all batch elements."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [
        jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in zip(args, dims)
    ]
    return _stall_p.bind(*args, **params), 0


batching.primitive_batchers[_stall_p] = _stall_batch


def stall_call(moving_mean, mean, variance, momentum, epsilon, threshold, token):
    """The stall test (tf_stable_moments/_advice.py) of one layer's float32 [c] vectors as
    one FFI call on the CPU: returns moving_mean itself (use it, so that XLA keeps the
    call); the reporter of `set_stall_reporter` hears of the first stall of `token`.  A
    computation lowered for another platform holds no call (moving_mean passes through).
    No derivative: the inputs are passed through stop_gradient."""
    if load() is None:
        raise RuntimeError("stall_call: the native kernel is unavailable or switched off")
    moving_mean, mean, variance = (jax.lax.stop_gradient(v) for v in (moving_mean, mean, variance))
    return _stall_p.bind(
        moving_mean,
        mean,
        variance,
        momentum=float(momentum),
        epsilon=float(epsilon),
        threshold=float(threshold),
        token=int(token),
    )
