"""The main job's layer section: keras's and Flax's normalization layers and ours on
offset data (Flax's rows where flax is installed: ``pip install ".[flax]"``).

Training-mode (BatchNormalization, LayerNormalization, GroupNormalization) or adapted
(Normalization) output on float32 N(offset, 1) data, gamma = 1, beta = 0, epsilon 1e-3,
against the same formula computed in float64 on the same float32 inputs:

    y = (x - mean) / sqrt(var + epsilon)    (Normalization: epsilon = 0)

The numbers are max |y_layer - y_float64| over the whole output; a correctly rounded
mean and variance leave only the few ulps of the output arithmetic (about 1e-6).
Eager TensorFlow on the active Keras backend's defaults; nothing is compiled.
"""

import numpy as np

OFFSETS = (1e6, 1e7)
EPSILON = 1e-3
# name, input shape, axes the statistics run over, keras class name
_CASES = (
    ("BatchNormalization [512, 16]", (512, 16), (0,), "BatchNormalization"),
    ("LayerNormalization [16, 512]", (16, 512), (1,), "LayerNormalization"),
    ("GroupNormalization [16, 512], 4 groups", (16, 512), None, "GroupNormalization"),
    ("Normalization.adapt [512, 16]", (512, 16), (0,), "Normalization"),
)


def _reference(x, axes, groups=None):
    x = x.astype(np.float64)
    if groups is not None:  # channels last, split into groups of consecutive channels
        g = x.reshape(x.shape[0], groups, -1)
        m, v = g.mean(2, keepdims=True), g.var(2, keepdims=True)
        return ((g - m) / np.sqrt(v + EPSILON)).reshape(x.shape)
    m, v = x.mean(axes, keepdims=True), x.var(axes, keepdims=True)
    return (x - m) / np.sqrt(v + EPSILON)


def _output(cls, kind, x):
    import keras

    if kind == "Normalization":
        layer = cls(axis=-1)
        layer.adapt(x)
        return keras.ops.convert_to_numpy(layer(x))
    kwargs = {"groups": 4} if kind == "GroupNormalization" else {}
    layer = cls(epsilon=EPSILON, **kwargs)
    return keras.ops.convert_to_numpy(layer(x, training=True))


_FLAX_CASES = (
    ("flax.linen.BatchNorm [512, 16]", (512, 16), (0,), "BatchNorm"),
    ("flax.linen.LayerNorm [16, 512]", (16, 512), (1,), "LayerNorm"),
    ("flax.linen.GroupNorm [16, 512], 4 groups", (16, 512), None, "GroupNorm"),
)


def _flax_output(cls, kind, x):
    import jax

    kwargs = {"epsilon": EPSILON}
    if kind == "BatchNorm":
        kwargs["use_running_average"] = False
    if kind == "GroupNorm":
        kwargs["num_groups"] = 4
    module = cls(**kwargs)
    variables = module.init(jax.random.PRNGKey(0), x)
    return np.asarray(module.apply(variables, x, mutable=["batch_stats"])[0])


def flax_rows():
    """{case: {offset: (Flax's error, ours error)}} for jax_kernel.flax.linen's classes
    beside Flax's; empty where flax is not installed."""
    try:
        import flax.linen as theirs
    except ImportError:
        return {}
    from jax_kernel.flax import linen as ours

    out = {}
    for name, shape, axes, kind in _FLAX_CASES:
        out[name] = {}
        for offset in OFFSETS:
            x = (offset + np.random.default_rng(0).standard_normal(shape)).astype(np.float32)
            want = _reference(x, axes, 4 if kind == "GroupNorm" else None)
            errors = [
                float(np.max(np.abs(_flax_output(getattr(m, kind), kind, x) - want)))
                for m in (theirs, ours)
            ]
            out[name][offset] = tuple(errors)
    return out


def layer_rows():
    """{case: {offset: (keras's or Flax's error, ours error)}} for every layer pair."""
    import keras

    import tf_stable_moments

    out = {}
    for name, shape, axes, kind in _CASES:
        ours = getattr(tf_stable_moments, "Stable" + kind)
        theirs = getattr(keras.layers, kind)
        out[name] = {}
        for offset in OFFSETS:
            x = (offset + np.random.default_rng(0).standard_normal(shape)).astype(np.float32)
            if kind == "Normalization":
                m, v = x.astype(np.float64).mean(0), x.astype(np.float64).var(0)
                want = (x - m) / np.sqrt(v)
            else:
                want = _reference(x, axes, 4 if kind == "GroupNormalization" else None)
            errors = [float(np.max(np.abs(_output(c, kind, x) - want))) for c in (theirs, ours)]
            out[name][offset] = tuple(errors)
    return {**out, **flax_rows()}


def format_layer_rows(rows):
    head = ["layer"] + [f"{who} N({o:g}, 1)" for o in OFFSETS for who in ("theirs", "ours")]
    lines = [head]
    for name, per in rows.items():
        cells = [name]
        for offset in OFFSETS:
            cells += [f"{e:.2g}" for e in per[offset]]
        lines.append(cells)
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    text = [
        "Normalization layers (theirs: keras's, or Flax's for the flax rows), training-mode",
        "(Normalization: adapted) output, float32, max |error| against the same formula in",
        "float64 (gamma 1, beta 0, epsilon 1e-3):",
    ]
    for r in lines:
        text.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(text)
