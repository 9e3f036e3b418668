"""The layers' output formulas (moments_core/_affine.py) in TensorFlow, differentiable
(the Keras layers reach them through tf_stable_moments/_formulas.py).

float32 and float64 operands take the formulas whose bits no compiler can change
(docs/algorithm.md section 14; float64 ones outside XLA as XLA computations of their own,
since TensorFlow's graph optimizer would regroup their sums); other dtypes and mixed
operands the plain expressions.  Gradients are those of the plain expressions, in the
operands' dtype: d(1/sqrt v) = -t**3 / 2 dv, d(a b) = b da + a db, d(r f + b) = f dr +
r df + db (the sums over broadcast axes in that dtype, as TensorFlow's own gradients of
* and +).
`div` and `blend` (renorm's corrections, moving averages, the masked variance:
quantities the layers use as constants) have none.
"""

import tensorflow as tf

from moments_core import _affine
from tf_stable_moments._ops import PLAIN, XLA
from tf_stable_moments._output_grad import scale_shift_grad, unbroadcast
from tf_stable_moments._xla_context import in_xla_context


def _kind(*tensors):
    """32 (float32 operands) or 64 (float64 operands), outside a `portable("tflite")`
    trace (TFLite has no float64 builtins: the plain expressions there, docs section 15);
    else None (the plain expressions)."""
    from tf_stable_moments import _native

    if _native.tflite_now():
        return None
    kinds = {tf.as_dtype(t.dtype) for t in tensors if t is not None}
    if len(kinds) != 1:
        return None
    return {tf.float32: 32, tf.float64: 64}.get(kinds.pop())


def _run64(name, fn, args):
    """fn(ops, *args) for float64 operands: the operations where XLA compiles the graph
    being built, else an XLA computation of its own (`_compiled`): TensorFlow's graph
    optimizer rewrites chains of additions (AddN), which would regroup the float64
    formulas' sums."""
    if in_xla_context():
        return fn(XLA, *args)
    return _compiled(name, fn, args)


def _run32(name, fn, args):
    """fn(ops, *args) for float32 operands: the operations (plain ones outside XLA, which
    give the same bits: docs section 14)."""
    del name
    return fn(XLA if in_xla_context() else PLAIN, *args)


def _differentiable(run, rsqrt_fn, times_fn, affine_fn):
    """(rsqrt, times, affine) of one kind, each run by `run`, with the plain expressions'
    gradients."""

    @tf.custom_gradient
    def rsqrt_(v):
        def grad(dt):
            # t recomputed by the plain expression: a few operations that XLA may fuse
            # anywhere (the certified t's 60 would be recomputed per element where the
            # gradient is used per element), and differentiable again
            t = 1.0 / tf.sqrt(v)
            return dt * (-0.5 * t * t * t)

        return run("rsqrt", rsqrt_fn, (v,)), grad

    @tf.custom_gradient
    def times_(a, b):
        def grad(dy):
            return unbroadcast(dy * b, a), unbroadcast(dy * a, b)

        return run("times", times_fn, (a, b)), grad

    @tf.custom_gradient
    def affine_(r, f, b):
        def grad(dy):
            return unbroadcast(dy * f, r), unbroadcast(dy * r, f), unbroadcast(dy, b)

        return run("affine", affine_fn, (r, f, b)), grad

    return rsqrt_, times_, affine_


_RUN = {32: _run32, 64: _run64}
_RSQRT, _TIMES, _AFFINE = (
    dict(zip((32, 64), fns))
    for fns in zip(
        _differentiable(_run32, _affine.rsqrt32, _affine.times32, _affine.affine32),
        _differentiable(_run64, _affine.rsqrt64, _affine.times64, _affine.affine64),
    )
)
_DIV = {32: _affine.div32, 64: _affine.div64}


def rsqrt(v):
    """1 / sqrt(v): RN(v**-0.5) for float32 and float64 v (the same bits everywhere)."""
    kind = _kind(v)
    return _RSQRT[kind](v) if kind else 1.0 / tf.sqrt(v)


def div(a, s):
    """a / s: RN(a / s) for float32 or float64 a and s; no derivative."""
    a, s = tf.stop_gradient(a), tf.stop_gradient(s)
    kind = _kind(a, s)
    if not kind:
        return a / s
    y = _RUN[kind]("div", _DIV[kind], (a, s))
    # per slice: a buffer of its own, not recomputed per element
    return XLA.materialize(y) if in_xla_context() else y


def recip(s):
    """1 / s: RN(1 / s) for float32 or float64 s; no derivative."""
    return div(tf.ones_like(s), s)


def times(a, b):
    """a * b: RN32(a * b) through float64, for float32 a and b (a and b of one rank, or
    scalars): a chain of products is not reordered; RN64(a * b) for float64
    (`_affine.times64`)."""
    kind = _kind(a, b)
    return _TIMES[kind](a, b) if kind else a * b


def affine(r, f, b=None):
    """r * f + b: RN32(RN64(r * f + b)) for float32 operands (f and b of r's rank, or
    scalars), `_affine.affine64` for float64; b None: `times`."""
    if b is None:
        return times(r, f)
    kind = _kind(r, f, b)
    return _AFFINE[kind](r, f, b) if kind else r * f + b


def _compiled(name, fn, args, **options):
    """fn(XLA, *args, **options) as a function of its own (tf_stable_moments/_moments.py
    `_compiled`: per TensorFlow context, traced once per name, options, ranks and
    dtypes).  Outside XLA it is an XLA computation of its own, so that eager mode and
    plain graphs run the formulas as one fused pass, as XLA does, rather than as a dozen
    operations over the whole tensor (in eager mode op by op they took twice as long: a
    BatchNormalization training step on [8, 8, 8, 64], 2.0x keras's against 1.25x
    compiled).  Where XLA compiles the graph being built it is a plain function call,
    which XLA inlines: each layer adds one call to the graph, not the formulas' hundred
    operations (ten BatchNormalization layers under jit_compile: 1.3 s less tracing).
    The bits are the same (docs section 14).

    Traced for an export (`_native.portable_now`) with float32 operands, it is a plain
    function instead (float32 formulas have the same bits in plain operations: docs
    section 14; float64 ones keep XLA, `_run64`), one call that TensorFlow's graph
    optimizer does not inline.  So a loaded artifact compiles nothing for a new shape:
    an XLA computation per shape cost about 35 ms at the first call of each (an exported
    ResNet50: nine BatchNormalization shapes, first call 1.6x keras's; plain: 1.16x),
    and the optimizer rewrites the body once, not per layer (inlined: 2.9x).  The price
    is the steady call: several passes per output element where XLA fuses one (an
    exported ResNet50's serving call 1.26-1.34x keras's against 1.07-1.15x;
    benchmarks/export.py, README "Deploying")."""
    from tf_stable_moments import _moments, _native

    spec = [tf.TensorSpec([None] * a.shape.rank, a.dtype) for a in args]
    key = (
        "output",
        name,
        tuple(sorted(options.items())),
        tuple((s.shape.rank, s.dtype) for s in spec),
    )
    if in_xla_context():
        ops, jit, noinline = XLA, None, False
    elif _native.portable_now() and all(s.dtype == tf.float32 for s in spec):
        ops, jit, noinline = PLAIN, False, True
    else:
        ops, jit, noinline = XLA, True, False
    compiled = _moments._compiled(key, lambda *a: fn(ops, *a, **options), spec, jit, noinline)
    return compiled(*args)


def _native_formula(name, x):
    """The native CPU op of formula `name` where it serves x (outside XLA, on the CPU,
    the native kernel on and not tracing for an export), else None: the same bits."""
    if in_xla_context():
        return None
    from tf_stable_moments import _native

    return _native.formula_op(name, x)


def blend(a, wa, b, wb):
    """a * wa + b * wb: RN32(RN64(a wa + b wb)) for float32 operands, `_affine.blend64`
    for float64; no derivative."""
    a, b = tf.stop_gradient(a), tf.stop_gradient(b)
    wa, wb = (tf.constant(w, a.dtype) if not tf.is_tensor(w) else w for w in (wa, wb))
    kind = _kind(a, wa, b, wb)
    if kind == 64:
        return _run64("blend64", _affine.blend64, (a, wa, b, wb))
    if kind == 32:  # (weights of any rank that broadcasts: scalars)
        native = _native_formula("blend", a)
        if native is not None:
            return native(a, wa, b, wb)
        return _compiled("blend", _affine.blend32, (a, wa, b, wb))
    return a * wa + b * wb


def scale_shift(r, v, gamma=None, beta=None, shared=False):
    """A layer's output from r, v = var + eps (per slice, broadcast against r), gamma,
    beta: `_affine.scale_shift32` (docs section 14) for float32, one fused XLA pass
    outside XLA too (traced for an export: a plain function, `_compiled`); shared:
    gamma has t's shape (BatchNormalization), else gamma is per feature (LN, GN).  The
    gradient is the plain expression's (`scale_shift_grad`):
    the native op's registered gradient where the op serves, else a custom gradient."""
    kind = _kind(r, v, gamma, beta)
    if kind is None:
        t = 1.0 / tf.sqrt(v)
        scale = t if gamma is None else gamma * t
        return r * scale if beta is None else r * scale + beta
    native = _native_formula("scale_shift", r) if kind == 32 else None
    if native is not None:  # one CPU op (stable_moments_op.cc), its gradient registered
        unused = tf.zeros([], r.dtype)
        return native(
            r,
            v,
            unused if gamma is None else gamma,
            unused if beta is None else beta,
            has_gamma=gamma is not None,
            has_beta=beta is not None,
            shared=shared,
        )
    present = [a for a in (gamma, beta) if a is not None]

    @tf.custom_gradient
    def fn(r, v, *present):
        g, b = _unpack(present, gamma, beta)
        t = _native_t(v) if kind == 32 else None  # rsqrt32's chain, compiled per layer
        y = _compiled(
            "scale_shift",
            _scale_shift_args,
            (r, v if t is None else t, *present),
            has_gamma=g is not None,
            has_beta=b is not None,
            shared=shared,
            given_t=t is not None,
        )

        def grad(dy):
            return [d for d in scale_shift_grad(dy, r, v, g, b, shared) if d is not None]

        return y, grad

    return fn(r, v, *present)


def _unpack(present, gamma, beta):
    present = list(present)
    g = present.pop(0) if gamma is not None else None
    b = present.pop(0) if beta is not None else None
    return g, b


def _native_t(v):
    """t = rsqrt32(v) of a float32 v as the native custom call where it serves (inside XLA
    on the CPU with the native library, `_native.xla_available`: not while tracing
    portably; v of a static shape), else None."""
    if not in_xla_context() or not v.shape.is_fully_defined():
        return None
    from tf_stable_moments import _native

    return _native.xla_rsqrt(v) if _native.xla_available() else None


def _scale_shift_args(ops, r, v, *present, has_gamma, has_beta, shared, given_t=False):
    """The formula of r's dtype; given_t: v is the float32 t = rsqrt32(var + eps) itself."""
    g = present[0] if has_gamma else None
    b = present[-1] if has_beta else None
    if given_t:
        return _affine.scale_shift32(ops, r, None, g, b, shared, t=v)
    scale_shift = _affine.scale_shift64 if r.dtype == tf.float64 else _affine.scale_shift32
    return scale_shift(ops, r, v, g, b, shared)
