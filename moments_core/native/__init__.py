"""The native kernel: moments.h (C++) and its build (build.py); no TF or JAX import.

Also what both framework bindings share: the switch and the layout the kernel reads.
"""

import functools
import operator
import os


def enabled():
    """False when TF_STABLE_MOMENTS_NATIVE=0 (the native kernel is switched off)."""
    return os.environ.get("TF_STABLE_MOMENTS_NATIVE", "1") != "0"


def _product(dims):
    return functools.reduce(operator.mul, dims, 1)  # ints, or TF int64 scalars


def layout(dims, axes):
    """(perm, [outer, n, inner]): how the kernel reads x of shape `dims` reduced over the
    sorted `axes`.  Adjacent reduced axes need no transpose (perm None): outer and inner
    are the products of the dimensions before and after them.  Otherwise x is first
    transposed by perm (kept axes first, reduced ones last) and read as [kept, n, 1].
    The kept axes keep their order either way, so the results reshape to them."""
    n = _product([dims[a] for a in axes])
    if not axes or axes == tuple(range(axes[0], axes[-1] + 1)):
        before = dims[: axes[0]] if axes else dims
        after = dims[axes[-1] + 1 :] if axes else []
        return None, [_product(before), n, _product(after)]
    kept = [a for a in range(len(dims)) if a not in axes]
    return kept + list(axes), [_product([dims[a] for a in kept]), n, 1]
