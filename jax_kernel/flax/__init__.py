"""Flax drop-ins on the certified kernel (``pip install ".[flax]"``).

`jax_kernel.flax.linen` and `jax_kernel.flax.nnx`: BatchNorm, LayerNorm and GroupNorm
with Flax's fields,
defaults, variable collections and names, whose statistics are the correctly rounded
mean and variance (docs/algorithm.md) and which centre the input with the mean's two
parts (section 9), so that their outputs stay accurate on data far from zero.
"""
