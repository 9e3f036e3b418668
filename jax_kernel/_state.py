"""A mergeable moments state for JAX: exact statistics across devices and streams.

The same state as ``tf_stable_moments.moments_state`` (the same bits;
moments_core/_state.py, docs/algorithm.md section 13).  `MomentsState` is a
pytree (values the leaf, the data's dtype static), so collectives apply to it:

    state = moments_state(x_shard, axes=0)          # inside shard_map / pmap
    state = jax.lax.psum(state, "devices")          # exact: int32 digit sums
    mean, var = state_moments(state)                # the bits of moments(all data)

States are int32: no 64-bit mode is needed outside the kernel.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jax_kernel import _moments, _native, _ops
from jax_kernel._moments import _ShapedArray
from moments_core import _state
from moments_core._formats import FORMATS
from moments_core._validate import canonical_axes, check_ddof, out_shape

__all__ = ["MomentsState", "accumulate_state", "merge_states", "moments_state", "state_moments"]


def _layout(dtype):
    work = _moments._compute_dtype(dtype)
    return _state.Layout(FORMATS[np.dtype(work).name], 2 if np.dtype(dtype).kind == "c" else 1)


def state_size(dtype):
    """The length L of the state of one slice of inputs of `dtype` (int32 digits)."""
    return _layout(dtype).size


@jax.tree_util.register_pytree_node_class
class MomentsState:
    """The exact moments state of a batch of slices: `values` [*kept_dims, L] int32, `dtype`.

    A pytree: `values` is its leaf and `dtype` (of the summarised data) static,
    so ``jax.lax.psum(state, axis_name)`` sums the values of all devices: up to
    2**15 states sum exactly, and the sum is a valid state (`merge_states` and
    `state_moments` carry it into canonical form).  Immutable.
    """

    __slots__ = ("values", "dtype")

    def __init__(self, values, dtype):
        try:
            dtype = np.dtype(dtype)
        except TypeError as err:
            raise TypeError(f"MomentsState: dtype must be a dtype; got dtype={dtype!r}") from err
        size = _layout(dtype).size
        values = jnp.asarray(values)
        if values.dtype != np.int32:
            raise TypeError(
                f"MomentsState: values must be int32 digits; got values of dtype {values.dtype}"
            )
        if values.ndim == 0 or values.shape[-1] != size:
            raise ValueError(
                f"MomentsState: a state of {dtype.name} data has {size} digits per slice "
                f"(values.shape[-1]); got values of shape {values.shape}"
            )
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "dtype", dtype)

    def __setattr__(self, name, value):
        raise AttributeError("MomentsState is immutable")

    @property
    def shape(self):
        """The kept dimensions: one state per slice."""
        return tuple(self.values.shape[:-1])

    def __repr__(self):
        return f"MomentsState(shape={self.shape}, dtype={self.dtype.name})"

    def tree_flatten(self):
        return (self.values,), self.dtype

    @classmethod
    def tree_unflatten(cls, dtype, children):
        # Leaves may be tracers, shardings or placeholders: no validation here.
        state = object.__new__(cls)
        object.__setattr__(state, "values", children[0])
        object.__setattr__(state, "dtype", dtype)
        return state


def _check_state(state, fn, arg):
    if not isinstance(state, MomentsState):
        raise TypeError(f"{fn}: {arg} must be a MomentsState; got {arg}={state!r}")
    return state


def _xla_state(x, where, axes, one_pass=True):
    """The state's values in XLA: in one pass where the inputs have at most 24 bits (and
    one_pass), else the digits of every element (`_state.from_rows`)."""
    parts, axis, fmt, _ = _moments._kernel_parts(x, axes)
    layout = _state.Layout(fmt, len(parts))
    kept = out_shape(x.shape, axes, False)
    with jax.enable_x64(True):
        valid = None
        if where is not None:
            valid, _ = _moments._layout(jnp.broadcast_to(where, x.shape), axes)
        if one_pass and _state.one_pass_applies(fmt):
            digits = _state.from_one_pass(_ops, parts, valid, fmt, axis)
        else:  # rows layout: the elements of a slice along axis 1
            rows = [p.astype(np.float64) for p in parts]
            if axis == 0:
                rows = [r.T for r in rows]
                valid = None if valid is None else valid.T
            digits = _state.from_rows(_ops, rows, valid, fmt)
        return digits.astype(np.int32).reshape(*kept, layout.size)


_state_values = jax.jit(_xla_state, static_argnums=(2, 3))


def _native_state(x, axes):
    """The state's values from the native kernel's one pass (the CPU's FFI call)."""
    data, fmt, _ = _moments.native_data(x, axes)
    layout = _state.Layout(fmt, data.shape[-1])
    values = _native.state_call(data, fmt, layout.l1, layout.l2)
    return values.reshape(*out_shape(x.shape, axes, False), layout.size)


def _per_platform(name, abstract, choose, batch, multiple_results=False):
    """A primitive computed by `choose(native, **params)(operand)`: the native FFI call where
    it runs on the CPU (lowered for it, not for an exported artifact, and its `native`
    parameter allows it), the XLA computation everywhere else, as `_moments._stats_p`
    chooses the kernel; both give the same bits.  Outside jit it runs its platform's choice
    compiled once per parameters; `batch` is its vmap rule."""
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_abstract_eval(abstract)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def compiled(operand, native, items):
        return choose(native, **dict(items))(operand)

    def impl(operand, *, native, **params):
        native = native and _native.concrete_platform(operand) == "cpu"
        return compiled(operand, native, tuple(sorted(params.items())))

    def lowering(platform):
        def lower(ctx, operand, *, native, **params):
            native = native and platform == "cpu" and not _native.for_export(ctx)
            fn = choose(native, **params)
            return mlir.lower_fun(fn, multiple_results=multiple_results)(ctx, operand)

        return lower

    prim.def_impl(impl)
    mlir.register_lowering(prim, lowering(None))
    mlir.register_lowering(prim, lowering("cpu"), platform="cpu")
    batching.primitive_batchers[prim] = batch
    return prim


def _state_abstract(x, *, axes, native):
    kept = out_shape(x.shape, axes, False)
    return _ShapedArray((*kept, _layout(x.dtype).size), np.int32)


def _state_fn(native, axes):
    if native:
        return lambda x: _native_state(x, axes)
    return lambda x: _xla_state(x, None, axes)


def _state_batch(args, dims, *, axes, native):
    """vmap: the batch axis becomes the first kept axis, so the states' first axis."""
    (x,), (bd,) = args, dims
    x = jnp.moveaxis(x, bd, 0)
    return _state_p.bind(x, axes=tuple(a + 1 for a in axes), native=native), 0


_state_p = _per_platform("tf_stable_moments_state", _state_abstract, _state_fn, _state_batch)


def moments_state(x, axes=None, *, where=None):
    """The exact moments state of each slice of `x` over `axes` (merge it, then round it).

    Same contract as ``tf_stable_moments.moments_state`` (the same bits): per
    slice n, S1 = sum x_i and S2 = sum x_i**2 as exact integers and the NaN,
    +inf and -inf counts per real part.  Works under jax.jit, shard_map, pmap
    and vmap; no 64-bit mode needed.  Computations lowered for the CPU take it
    from the native kernel (one FFI call, no `where`); others from the XLA one
    pass (docs/algorithm.md section 13).

    Args:
      x: array of dtype float16, bfloat16, float32, float64, complex64 or
        complex128 (possibly empty: a valid state with n = 0).
      axes: the reduced axes (int, sequence of ints, or None for all).
      where: optional bool array broadcastable to x: only elements where it is
        True count.

    Returns:
      A MomentsState with values [*kept_dims, L] int32 and dtype x.dtype.
    """
    x = jnp.asarray(x)
    _moments._compute_dtype(x.dtype)
    axes = canonical_axes(axes, x.ndim, "moments_state")
    if where is not None:
        where = jnp.asarray(where)
        if where.dtype != np.bool_:
            raise TypeError(
                f"moments_state: where must be a bool array; got where of dtype {where.dtype}"
            )
    if where is None:
        values = _state_p.bind(x, axes=tuple(axes), native=_moments._use_native())
    else:
        values = _state_values(x, where, axes)
    return MomentsState(values, x.dtype)


@functools.partial(jax.jit, static_argnums=(2,))
def _merge(a, b, dtype):
    layout = _layout(dtype)
    with jax.enable_x64(True):
        flat = [v.reshape(-1, layout.size).astype(np.int64) for v in (a, b)]
        merged = _state.merge(_ops, flat[0], flat[1], layout)
        return merged.astype(np.int32).reshape(a.shape)


def merge_states(a, b):
    """The state of the union of the data of `a` and `b`: canonical, so associative and
    commutative in bits.  a and b must summarise data of one dtype and slice shape; either
    may be a sum of states (at most 2**15 states in all)."""
    _check_state(a, "merge_states", "a")
    _check_state(b, "merge_states", "b")
    if a.dtype != b.dtype:
        raise ValueError(
            "merge_states: the states summarise data of different dtypes; got "
            f"a.dtype={a.dtype.name}, b.dtype={b.dtype.name}"
        )
    if a.shape != b.shape:
        raise ValueError(
            "merge_states: the states have different slice shapes; got "
            f"a.shape={a.shape}, b.shape={b.shape}"
        )
    return MomentsState(_merge(a.values, b.values, a.dtype), a.dtype)


def _xla_finish(values, dtype, ddof):
    """state_moments in XLA: carry, then `_state.values`."""
    layout = _layout(dtype)
    work = _moments._compute_dtype(dtype)
    shape = values.shape[:-1]
    with jax.enable_x64(True):
        ddof = jnp.asarray(ddof, np.int64)
        digits = values.reshape(-1, layout.size).astype(np.int64)
        digits = _state.carry(_ops, digits, layout.lengths, 31)
        means, var = _state.values(_ops, digits, layout, ddof)
        means = [m.astype(work) for m in means]
        var = var.astype(work).reshape(shape)
    mean = means[0] if len(means) == 1 else jax.lax.complex(means[0], means[1])
    return mean.reshape(shape), var


def _wide_var(x, where, axes, ddof):
    """The variance of x's data over axes rounded once to float64 (float64 [*kept]) from
    the exact state: the variance of the data widened to float64 (inputs below the
    format's normal range count as 0), for `std`."""
    state = moments_state(x, axes, where=where)
    layout = _layout(state.dtype)
    with jax.enable_x64(True):
        # A state made here is canonical: no carry (one was 0.2 s of XLA compile time).
        digits = state.values.reshape(-1, layout.size).astype(np.int64)
        ddof = jnp.asarray(ddof, np.int64)
        _, var = _state.values(_ops, digits, layout, ddof, FORMATS["float64"])
    return var.reshape(state.values.shape[:-1])


def _native_finish(values, dtype, ddof):
    """state_moments from the native kernel (the CPU's FFI call): the same bits."""
    layout = _layout(dtype)
    work = _moments._compute_dtype(dtype)
    carrier = np.float64 if work == np.float64 else np.float32
    mean, var = _native.state_moments_call(
        values, ddof, layout.fmt, layout.parts, layout.l1, layout.l2, carrier
    )
    means = [mean[..., j].astype(work) for j in range(layout.parts)]
    mean = means[0] if len(means) == 1 else jax.lax.complex(means[0], means[1])
    return mean, var.astype(work)


def _finish_abstract(values, *, dtype, ddof, native):
    work = _moments._compute_dtype(dtype)
    kept = values.shape[:-1]
    mean = np.dtype(dtype) if np.dtype(dtype).kind == "c" else work
    return [_ShapedArray(kept, mean), _ShapedArray(kept, work)]


def _finish_fn(native, dtype, ddof):
    finish = _native_finish if native else _xla_finish
    return lambda v: list(finish(v, dtype, ddof))


def _finish_batch(args, dims, **params):
    """vmap: the batch axis first, as one more kept axis of the states and the results."""
    (values,), (bd,) = args, dims
    return _finish_p.bind(jnp.moveaxis(values, bd, 0), **params), [0, 0]


# state_moments, lowered per platform as `_state_p` is.
_finish_p = _per_platform(
    "tf_stable_moments_state_moments",
    _finish_abstract,
    _finish_fn,
    _finish_batch,
    multiple_results=True,
)


def state_moments(state, ddof=0):
    """(mean, variance) of the data a state summarises, each correctly rounded: the bits of
    ``moments(data, axes, ddof=ddof)`` on all the data merged into `state`, with the same
    special values (see ``tf_stable_moments.state_moments``)."""
    _check_state(state, "state_moments", "state")
    ddof = check_ddof(ddof, "state_moments")
    native = _moments._use_native()
    mean, var = _finish_p.bind(state.values, dtype=state.dtype, ddof=ddof, native=native)
    return mean, var


def _kept(shape, axes):
    reduced = canonical_axes(axes, len(shape), "accumulate_state")
    return [d for i, d in enumerate(shape) if i not in reduced]


def accumulate_state(batches, axes=None):
    """The moments state of a stream of batches: each batch's state, merged (streaming).

    ``state_moments(accumulate_state(batches, axes), ddof)`` is the correctly
    rounded mean and variance of all the batches joined along the reduced axes:
    the bits of `moments` on the whole however the data are cut, and those of
    ``tf_stable_moments.accumulate_state``.  batches: an iterable of arrays (one
    `moments_state` and one `merge_states` per batch, iterated in Python; each
    new batch shape compiles once), all of one dtype, rank and kept dimensions.

    Raises:
      TypeError: batches is a single array or not iterable.
      ValueError: an empty iterable, batches of different dtypes, ranks or kept
        dimensions.
    """
    fn = "accumulate_state"
    if isinstance(batches, (np.ndarray, jax.Array)) or not hasattr(batches, "__iter__"):
        raise TypeError(
            f"{fn}: batches must be an iterable of batches (pass [x] for one array); "
            f"got batches of type {type(batches).__name__}"
        )
    return _state.merge_stream(
        batches,
        axes,
        jnp.asarray,
        lambda x: (x.dtype.name, x.ndim, _kept(x.shape, axes)),
        moments_state,
        merge_states,
    )
