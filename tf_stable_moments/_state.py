"""A mergeable moments state for TensorFlow: exact statistics across replicas and streams.

`moments_state(x, axes)` turns each slice into a fixed-length int32 vector of
exact integer sums (moments_core/_state.py, docs/algorithm.md section 13);
`merge_states(a, b)` merges two states exactly; `state_moments(state, ddof)`
rounds the merged sums once: the bits of `moments` on the concatenated data.
Every digit of a state is below 2**16, so an int32 all-reduce SUM of up to
2**15 states is exact in any order:

    ctx = tf.distribute.get_replica_context()
    state = moments_state(x_local, axes=[0])
    total = MomentsState(ctx.all_reduce(tf.distribute.ReduceOp.SUM, state.values), state.dtype)
    mean, var = state_moments(total)      # the same bits on every replica
"""

import threading

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context as _context

from moments_core import _state
from moments_core._formats import FORMATS
from moments_core._validate import canonical_axes, check_ddof
from tf_stable_moments import _moments, _native, _ops
from tf_stable_moments._xla_context import in_xla_context

__all__ = ["MomentsState", "accumulate_state", "merge_states", "moments_state", "state_moments"]

_OPS = _ops.PLAIN  # integer operations only: the same in eager mode, graphs and XLA


def _layout(dtype):
    work = _moments._compute_dtype(dtype)
    return _state.Layout(FORMATS[work.name], 2 if dtype.is_complex else 1)


def state_size(dtype):
    """The length L of the state of one slice of inputs of `dtype` (int32 digits)."""
    return _layout(tf.as_dtype(dtype)).size


class MomentsState:
    """The exact moments state of a batch of slices: `values` [*kept_dims, L] int32, `dtype`.

    `values` holds per slice the count, the exact sums S1 (per real part) and S2
    and the NaN/+inf/-inf counts as radix-2**16 digits (docs/algorithm.md,
    section 13); `dtype` is the dtype of the data it summarises (static).  The
    sum of up to 2**15 states' `values` (for example an all-reduce SUM over
    replicas) is the `values` of their merge: rebuild it with
    ``MomentsState(summed_values, state.dtype)``.  Immutable.
    """

    __slots__ = ("values", "dtype")

    def __init__(self, values, dtype):
        try:
            dtype = tf.as_dtype(dtype)
        except TypeError as err:
            raise TypeError(f"MomentsState: dtype must be a dtype; got dtype={dtype!r}") from err
        size = _layout(dtype).size
        values = tf.convert_to_tensor(values)
        if values.dtype != tf.int32:
            raise TypeError(
                "MomentsState: values must be int32 digits; "
                f"got values of dtype {values.dtype.name}"
            )
        if values.shape.rank == 0 or values.shape[-1] not in (None, size):
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
        return self.values.shape[:-1]

    def __repr__(self):
        return f"MomentsState(shape={self.shape}, dtype={self.dtype.name})"


def _check_state(state, fn, arg):
    if not isinstance(state, MomentsState):
        raise TypeError(f"{fn}: {arg} must be a MomentsState; got {arg}={state!r}")
    return state


# Graph functions are kept per TensorFlow context (a reset context starts afresh) and hold
# no tensor; only eager calls use them (graphs build the operations in place).
_lock = threading.Lock()
_cache = {"context": None, "functions": {}}


def _eager_function(key, fn, spec):
    ctx = _context.context()
    with _lock:
        if _cache["context"] is not ctx:
            _cache.update(context=ctx, functions={})
        if key not in _cache["functions"]:
            _cache["functions"][key] = tf.function(fn, input_signature=spec, autograph=False)
        return _cache["functions"][key]


def _run(key, fn, args):
    """fn(*args): built in place in a graph; in eager mode, a graph function of this
    context traced once per key, argument dtypes and ranks (any dimensions)."""
    if not tf.executing_eagerly():
        return fn(*args)
    spec = [tf.TensorSpec([None] * a.shape.rank, a.dtype) for a in args]
    key = (*key, *((a.dtype, a.shape.rank) for a in args))
    return _eager_function(key, fn, spec)(*args)


@tf.autograph.experimental.do_not_convert
def moments_state(x, axes=None, *, where=None, name=None):
    """The exact moments state of each slice of `x` over `axes` (merge it, then round it).

    Per slice, the state holds n, S1 = sum x_i and S2 = sum x_i**2 exactly, as
    integers in units of the format's lowest bit (X_i = x_i / 2**base), and the
    counts of NaN, +inf and -inf per real part.  `state_moments` of a merge of
    the states of shards gives mean = S1 / n and
    var = (n S2 - S1**2) / (n (n - ddof)), each rounded once: the bits of
    `moments` on the concatenated shards, whatever the order of merging.
    On the CPU outside XLA (no `where`) the native kernel takes it in one pass
    of exact integer sums (the op StableState, every dtype).  Elsewhere inputs
    of at most 24 bits (float32, float16, bfloat16, complex64) take one pass of
    exact float64 block sums (XLA; below 2**16 elements outside XLA, the exact
    digits of every element, which need no compilation); float64 and
    complex128 the digits of every element.  The same bits every way:
    docs/algorithm.md section 13 has the arguments and the costs.

    Args:
      x: a Tensor of dtype float16, bfloat16, float32, float64, complex64 or
        complex128, of known rank.  It may be empty (a valid state: n = 0).
      axes: the reduced axes (int or sequence of ints; None: all).
      where: optional bool Tensor broadcastable to x: only the elements where
        it is True count (n is their number per slice).
      name: name scope.

    Returns:
      A MomentsState with values [*kept_dims, L] int32 and dtype x.dtype.
      No gradient flows through it (integer sums).
    """
    with tf.name_scope(name or "moments_state"):
        x = tf.convert_to_tensor(x)
        _moments._compute_dtype(x.dtype)
        if x.shape.rank is None:
            raise ValueError(
                "moments_state: x must have a known rank; got a tensor of unknown rank"
            )
        axes = canonical_axes(
            tf.get_static_value(axes) if isinstance(axes, tf.Tensor) else axes,
            x.shape.rank,
            "moments_state",
        )
        x = tf.stop_gradient(x)
        if where is not None:
            where = tf.convert_to_tensor(where)
            if where.dtype != tf.bool:
                raise TypeError(
                    f"moments_state: where must be a bool tensor; got where of dtype "
                    f"{where.dtype.name}"
                )
            where = tf.broadcast_to(where, tf.shape(x))
        args = [x] if where is None else [x, where]
        return MomentsState(_state_call(axes, args), x.dtype)


# Below this many elements an input's state is taken in plain operations outside XLA: the
# one-pass XLA computation compiles in about 1.4 s per shape bucket on this 2-core CPU,
# the plain digits of 2**16 float32 elements take about 10 ms.
ONE_PASS_MIN = 1 << 16


def _state_call(axes, args):
    """The state's values: the native kernel where it serves (the CPU, no mask: the op,
    or inside a user's XLA computation of static shape a custom call); else in one pass
    where the inputs have at most 24 bits and XLA runs it (built into a user's XLA
    computation, else, from ONE_PASS_MIN elements or a size unknown while tracing, an
    XLA computation of its own on inputs padded with zeros to `_moments._bucket` sizes,
    so that shards of many lengths compile a few times); else the digits of every
    element in plain operations."""
    x = args[0]
    layout = _layout(x.dtype)
    if len(args) == 1:  # the native kernel's one pass (the CPU, no mask): op or custom call
        xla = in_xla_context()
        op = None if xla else _native.formula_op("state", x)
        custom = xla and x.shape.is_fully_defined() and _native.xla_available()
        if op is not None or custom:
            y, attrs, _ = _moments._native_input(x, axes, 0)
            del attrs["ddof"]
            if op is not None:
                return op(y, l1=layout.l1, l2=layout.l2, **attrs)
            shape = [*_moments._out_shape(x, axes, False), layout.size]
            return _native.xla_state(y, attrs, layout.l1, layout.l2, shape)
    size = x.shape.num_elements()  # None: not known while tracing
    small = size is not None and size < ONE_PASS_MIN
    if not _state.one_pass_applies(layout.fmt) or (
        not in_xla_context() and (small or not _moments._use_xla())
    ):
        return _run(("state", axes), _state_values(axes), args)
    parts, axis = [], None
    for part in _moments._parts(x):
        laid, axis = _moments._layout(part, axes)
        parts.append(laid)
    valid = None if len(args) == 1 else _moments._layout(args[1], axes)[0]
    fmt = layout.fmt
    if in_xla_context():
        digits = _state.from_one_pass(_ops.XLA, parts, valid, fmt, axis)
        return _shaped(tf.cast(digits, tf.int32), x, axes, layout)
    dims = _moments._dims(parts[0])
    pads = [[0, tf.cast(_moments._bucket(d) - d, tf.int32)] for d in dims]
    data = [tf.pad(p, pads) for p in parts] + ([] if valid is None else [tf.pad(valid, pads)])
    k = len(parts)

    def fn(*a):
        v = None if valid is None else a[k]
        return _state.from_one_pass(_ops.XLA, list(a[:k]), v, fmt, axis, a[-1])

    spec = [tf.TensorSpec([None, None], d.dtype) for d in data] + [tf.TensorSpec([], tf.int64)]
    key = ("one_pass", axis, k, parts[0].dtype, valid is None)
    count = tf.cast(dims[axis], tf.int64)
    digits = _moments._compiled(key, fn, spec)(*data, count)[: dims[1 - axis]]
    return _shaped(tf.cast(digits, tf.int32), x, axes, layout)


def _shaped(digits, x, axes, layout):
    """digits [slices, L] as [*kept_dims, L]."""
    shape = _moments._out_shape(x, axes, False)
    if tf.is_tensor(shape):
        shape = tf.concat([tf.cast(shape, tf.int64), [layout.size]], 0)
    else:
        shape = [*shape, layout.size]
    return tf.reshape(digits, shape)


def _state_values(axes):
    def fn(x, where=None):
        layout = _layout(x.dtype)
        rows = []
        for part in _moments._parts(x):
            laid, axis = _moments._layout(part, axes)
            laid = tf.cast(laid, tf.float64)
            rows.append(laid if axis == 1 else tf.transpose(laid))
        valid = None
        if where is not None:
            valid, axis = _moments._layout(where, axes)
            valid = valid if axis == 1 else tf.transpose(valid)
        digits = tf.cast(_state.from_rows(_OPS, rows, valid, layout.fmt), tf.int32)
        return _shaped(digits, x, axes, layout)

    return fn


@tf.autograph.experimental.do_not_convert
def merge_states(a, b, name=None):
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
    if not a.values.shape.is_compatible_with(b.values.shape):
        raise ValueError(
            "merge_states: the states have different slice shapes; got "
            f"a.shape={a.shape}, b.shape={b.shape}"
        )
    with tf.name_scope(name or "merge_states"):
        layout = _layout(a.dtype)
        shape = tf.shape(a.values)
        flat = [tf.reshape(v, [-1, layout.size]) for v in (a.values, b.values)]
        merged = _run(("merge", a.dtype), _merge(layout), flat)
        return MomentsState(tf.reshape(merged, shape), a.dtype)


def _merge(layout):
    def fn(a, b):
        digits = _state.merge(_OPS, tf.cast(a, tf.int64), tf.cast(b, tf.int64), layout)
        return tf.cast(digits, tf.int32)

    return fn


def _finish(layout, dtype):
    work = _moments._compute_dtype(dtype)

    def fn(values, ddof):
        digits = _state.carry(_OPS, tf.cast(values, tf.int64), layout.lengths, 31)
        means, var = _state.values(_OPS, digits, layout, ddof)
        means = [tf.cast(m, work) for m in means]
        mean = means[0] if len(means) == 1 else tf.complex(means[0], means[1])
        return mean, tf.cast(var, work)

    return fn


@tf.autograph.experimental.do_not_convert
def state_moments(state, ddof=0, name=None):
    """(mean, variance) of the data a state summarises, each correctly rounded.

    mean = S1 / n, var = (n S2 - S1**2) / (n (n - ddof)) from the exact sums,
    rounded once to the target format: the bits of `moments(data, axes,
    ddof=ddof)` on all the data merged into `state`, with the same special
    values (NaN or Inf in a slice: var NaN, the mean by IEEE rules per real part;
    n - ddof <= 0: var NaN; n = 0: both NaN).

    Args:
      state: a MomentsState (possibly an all-reduced sum of at most 2**15 states).
      ddof: delta degrees of freedom, a non-negative int.
      name: name scope.

    Returns:
      (mean, variance) shaped like the state's kept dimensions, of its dtype
      (variance real for complex data).
    """
    _check_state(state, "state_moments", "state")
    ddof = check_ddof(ddof, "state_moments")
    with tf.name_scope(name or "state_moments"):
        layout = _layout(state.dtype)
        op = None if in_xla_context() else _native.formula_op("state_moments", state.values)
        if op is not None:  # the native op (the CPU, outside XLA): the same bits
            return _native_state_moments(op, state, layout, ddof)
        fn = _finish(layout, state.dtype)
        flat = tf.reshape(state.values, [-1, layout.size])
        mean, var = _run(("finish", state.dtype), fn, [flat, tf.constant(ddof, tf.int64)])
        shape = tf.shape(state.values)[:-1]
        return tf.reshape(mean, shape), tf.reshape(var, shape)


def _native_state_moments(op, state, layout, ddof):
    work = _moments._compute_dtype(state.dtype)
    fmt = layout.fmt
    carrier = tf.float64 if work == tf.float64 else tf.float32
    mean, var = op(
        state.values,
        T=carrier,
        ddof=ddof,
        precision=fmt.precision,
        emin=fmt.emin,
        emax=fmt.emax,
        parts=layout.parts,
        l1=layout.l1,
        l2=layout.l2,
    )
    means = [tf.cast(mean[..., j], work) for j in range(layout.parts)]
    mean = means[0] if len(means) == 1 else tf.complex(means[0], means[1])
    return mean, tf.cast(var, work)


def _wide_moments(state, ddof=0):
    """(mean, variance) of the data of a state, each rounded once to float64 (float64
    [*kept_dims]): the sums are exact, so a state of float32 data gives the moments of
    the data widened to float64 (inputs below float32's normal range count as 0, as
    TensorFlow's CPU kernels read them) without a second state of the widened data
    (StableNormalization.adapt's second part of the mean; reduce_std's variance).
    The state is canonical, as `moments_state` and `merge_states` make it (both callers'):
    no carry, as in JAX's `_wide_var`."""
    _check_state(state, "_wide_moments", "state")
    layout = _layout(state.dtype)

    def fn(values, ddof):
        digits = tf.cast(values, tf.int64)
        means, var = _state.values(_OPS, digits, layout, ddof, FORMATS["float64"])
        return means[0], var

    flat = tf.reshape(state.values, [-1, layout.size])
    ddof = tf.constant(check_ddof(ddof, "_wide_moments"), tf.int64)
    mean, var = _run(("wide_moments", state.dtype), fn, [flat, ddof])
    shape = tf.shape(state.values)[:-1]
    return tf.reshape(mean, shape), tf.reshape(var, shape)


def _not_a_stream(batches, fn):
    if isinstance(batches, (np.ndarray, tf.Tensor, tf.Variable)) or not hasattr(
        batches, "__iter__"
    ):
        raise TypeError(
            f"{fn}: batches must be an iterable of batches or a tf.data.Dataset (pass [x] "
            f"for one array); got batches of type {type(batches).__name__}"
        )


def _kept(shape, axes):
    if shape.rank is None:
        return None
    reduced = canonical_axes(axes, shape.rank, "accumulate_state")
    return [d for i, d in enumerate(shape.as_list()) if i not in reduced]


def accumulate_state(batches, axes=None, name=None):
    """The moments state of a stream of batches: each batch's state, merged (streaming).

    For data that do not fit in memory: ``state_moments(accumulate_state(batches,
    axes), ddof)`` is the correctly rounded mean and variance of all the batches
    joined along the reduced axes, the bits of `moments` on the whole, however the
    data are cut (batches may differ in size along the reduced axes).

    Args:
      batches: an iterable of Tensors / numpy arrays (iterated in Python, one
        `moments_state` and one `merge_states` per batch), or a tf.data.Dataset
        whose elements are single Tensors (reduced with Dataset.reduce in one
        traced function; its element spec must give the dtype and the kept
        dimensions; an empty Dataset gives the empty state).  Every batch must
        have the same dtype, rank and kept dimensions.
      axes: the reduced axes of every batch (int or sequence of ints; None: all).
      name: name scope.

    Returns:
      A MomentsState (values [*kept_dims, L] int32).

    Raises:
      TypeError: batches is a single tensor/array or not iterable, or a batch
        (a Dataset element) is not a tensor of a supported dtype.
      ValueError: an empty iterable (no dtype to build a state of), batches of
        different dtypes or kept dimensions.
    """
    fn = "accumulate_state"
    _not_a_stream(batches, fn)
    with tf.name_scope(name or fn):
        if isinstance(batches, tf.data.Dataset):
            return _accumulate_dataset(batches, axes)
        return _state.merge_stream(
            batches,
            axes,
            tf.convert_to_tensor,
            lambda x: (x.dtype.name, x.shape.rank, _kept(x.shape, axes)),
            moments_state,
            merge_states,
        )


def _accumulate_dataset(dataset, axes):
    spec = dataset.element_spec
    if not isinstance(spec, tf.TensorSpec):
        raise TypeError(
            "accumulate_state: the elements of a tf.data.Dataset must be single tensors "
            f"(map (x, y) pairs to x first); got element_spec={spec}"
        )
    _moments._compute_dtype(spec.dtype)
    if spec.shape.rank is None:
        raise ValueError(
            f"accumulate_state: the Dataset's elements need a known rank; got element_spec={spec}"
        )
    reduced = canonical_axes(axes, spec.shape.rank, "accumulate_state")
    kept = [d for i, d in enumerate(spec.shape) if i not in reduced]
    if None in kept:
        raise ValueError(
            "accumulate_state: the Dataset's element spec must give the kept dimensions "
            f"(those not in axes); got element_spec={spec}, axes={axes}"
        )
    empty = tf.zeros([*kept, _layout(spec.dtype).size], tf.int32)  # no data: n = 0

    def step(values, x):
        state = merge_states(MomentsState(values, spec.dtype), moments_state(x, axes))
        return state.values

    return MomentsState(dataset.reduce(empty, step), spec.dtype)
