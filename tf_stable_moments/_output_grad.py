"""The gradient of the layers' output formula `scale_shift` (tf_stable_moments/_output.py),
shared by its tf.custom_gradient there and by the gradient registered for the native
StableScaleShift op (tf_stable_moments/_native/__init__.py): the plain expression's, in
the operands' dtype."""

import tensorflow as tf


def unbroadcast(g, like):
    """g summed over the axes along which `like` (of g's rank or lower) was broadcast."""
    lead = g.shape.rank - like.shape.rank
    axes = list(range(lead)) + [
        lead + i
        for i, (a, b) in enumerate(zip(like.shape, g.shape[lead:], strict=True))
        if a == 1 and b != 1
    ]
    if axes:
        g = tf.reduce_sum(g, axis=axes, keepdims=True)
    return tf.reshape(g, tf.shape(like)) if lead else g


def scale_shift_grad(dy, r, v, g, b, shared):
    """[dr, dv, dg, db] of `scale_shift` (None for an absent g or b): the plain
    expression's, in the operands' dtype, t = 1 / sqrt(v) recomputed by plain operations
    (so that higher orders work too).  Also the registered gradient of the native op
    (tf_stable_moments/_native/__init__.py)."""
    t = 1.0 / tf.sqrt(v)
    if g is None or shared:  # y = r (g t) + b: the sums of dy r and dy only
        s = unbroadcast(dy * r, t)
        dr = dy * (t if g is None else g * t)
        dt = s if g is None else s * g
        dg = None if g is None else s * t
    else:  # y = (r t) g + b, t per sample or group, g per feature
        dp = dy * g
        dr = dp * t
        dt = unbroadcast(dp * r, t)
        dg = unbroadcast(dy * (r * t), g)
    return [dr, dt * (-0.5 * t * t * t), dg, None if b is None else unbroadcast(dy, b)]
