"""The float32 variance kernel of the design note, written again from its text.

The note (``shared/seeds/001_0145c5a79a34801b.txt``, Section 2) describes four steps, all
in the input dtype and evaluated one slice at a time under ``jax.vmap``:

1. shift: ``y = x - x[0]``;
2. local centring: ``m = sum(y) / n``, ``d = y - m``;
3. compensated tree: the squares ``d * d`` (plain products) are summed by a binary tree
   whose nodes are TwoSum, the rounding errors being carried up in a second array; the
   result is the final sum plus the final carry;
4. two-term correction: ``var = max(s2/n - (s1/n)**2, 0)`` with ``s1 = sum(d)``.

The note does not say how ``s1`` is summed; here it goes through the same summation as the
squares.  The tree pairs neighbours (``v[0::2] + v[1::2]``) after zero padding to a power
of two.  A complex input is split into its real and imaginary parts and the two variances
are added (the note's rule).

``Steps`` switches each step off for the ablation of the note's Section 4, and switches on
two steps of this project's kernel that the note does not have: exact squares (``d * d``
as an unevaluated sum ``p + e`` built from products of 12-bit halves, ``e`` starting the
carries of the tree) and range scaling (an exact power-of-two scaling that puts the
largest magnitude of each slice in [2, 4), undone on the variance).  Only ``ddof = 0``.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

SUMMATIONS = ("compensated_tree", "tree", "kahan")


class Steps(NamedTuple):
    """Which steps the kernel performs; the defaults are the kernel of the note."""

    shift: bool = True
    summation: str = "compensated_tree"  # one of SUMMATIONS; "kahan" is a sequential scan
    two_term: bool = True
    exact_squares: bool = False
    range_scaling: bool = False


NOTE = Steps()


def two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e == a + b exactly (Ogita-Rump-Oishi Alg. 3.1)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _exponent(a):
    """floor(log2|a|) of a normal float32 (-127 for zero)."""
    return ((lax.bitcast_convert_type(a, jnp.int32) >> 23) & 0xFF) - 127


def _pow2(k):
    """2.0**k in float32 for an integer k in [-126, 127], built from its bits."""
    return lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)


def _split(a):
    """a == hi + lo exactly, hi rounded to 12 significant bits by a bit mask."""
    bits = lax.bitcast_convert_type(a, jnp.int32)
    hi = lax.bitcast_convert_type((bits + 0x800) & ~0xFFF, jnp.float32)
    return hi, a - hi


def _square(d, exact):
    """d * d, as (d * d, None) or, with exact squares, as a pair (p, e) with p + e ~ d**2."""
    if not exact:
        return d * d, None
    hi, lo = _split(d)
    p, e = two_sum(hi * hi, (hi + hi) * lo)
    return p, e + lo * lo


def _pad_to_power_of_two(v):
    size = 1 << max(v.shape[0] - 1, 0).bit_length()
    return jnp.pad(v, (0, size - v.shape[0]))


def _tree(h, carry):
    """Binary tree over neighbours; with a carry array every node is a TwoSum."""
    h = _pad_to_power_of_two(h)
    carry = None if carry is None else _pad_to_power_of_two(carry)
    while h.shape[0] > 1:
        left, right = h[0::2], h[1::2]
        if carry is None:
            h = left + right
        else:
            h, e = two_sum(left, right)
            carry = (carry[0::2] + carry[1::2]) + e
    return h[0] if carry is None else h[0] + carry[0]


def _kahan(v):
    """Kahan's compensated sum as a sequential loop (the note's previous version).

    A fori_loop with a dynamic index rather than a scan over `v`: under
    ``jax.disable_jit`` a scan compiles one slice per element, a dynamic index only one.
    """

    def step(i, state):
        s, c = state
        y = lax.dynamic_index_in_dim(v, i, keepdims=False) - c
        t = s + y
        return t, (t - s) - y

    s, _ = lax.fori_loop(1, v.shape[0], step, (v[0], jnp.zeros_like(v[0])))
    return s


def _sum(h, low, summation):
    """Sum of h (+ low, the low parts of exact squares, or None) by the chosen method."""
    if summation == "compensated_tree":
        return _tree(h, jnp.zeros_like(h) if low is None else low)
    total = _tree(h, None) if summation == "tree" else _kahan(h)
    if low is not None:
        total = total + _sum(low, None, summation)
    return total


def _slice_variance(x, steps):
    """Variance of one 1-D float32 slice."""
    n = x.shape[0]
    if steps.range_scaling:
        e = jnp.clip(1 - _exponent(jnp.max(jnp.abs(x))), -126, 127)
        x = x * _pow2(e)
    y = x - x[0] if steps.shift else x
    d = y - jnp.sum(y) / n
    p, low = _square(d, steps.exact_squares)
    var = _sum(p, low, steps.summation) / n
    if steps.two_term:
        var = var - (_sum(d, None, steps.summation) / n) ** 2
    var = jnp.maximum(var, 0)
    if steps.range_scaling:
        e1 = e >> 1
        u1, u2 = _pow2(-e1), _pow2(e1 - e)
        var = var * u1 * u1 * u2 * u2
    return var


def variance(x, axis, steps=NOTE):
    """Population variance of `x` (float32 or complex64) along one `axis`, by `steps`."""
    if steps.summation not in SUMMATIONS:
        raise ValueError(f"summation must be one of {SUMMATIONS}; got {steps.summation!r}")
    x = jnp.asarray(x)
    if jnp.iscomplexobj(x):
        return variance(jnp.real(x), axis, steps) + variance(jnp.imag(x), axis, steps)
    x = jnp.moveaxis(x, axis, -1)
    kept = x.shape[:-1]
    flat = x.reshape((-1, x.shape[-1]))
    return jax.vmap(lambda v: _slice_variance(v, steps))(flat).reshape(kept)
