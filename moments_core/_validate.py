"""Validation of the `axes` and `ddof` arguments, shared by the TF and JAX wrappers.

Pure Python and numpy: no TensorFlow or JAX import.  The TF wrapper resolves a
static tf.Tensor `axes` to a numpy array before calling `canonical_axes`.
"""

import numpy as np

__all__ = ["canonical_axes", "check_ddof", "out_shape"]

_MAX_REPR = 200


def _show(value):
    """repr(value), cut short for very long values."""
    text = repr(value)
    if len(text) > _MAX_REPR:
        text = text[: _MAX_REPR - 3] + "..."
    return text


def _is_int(value):
    """A Python int or numpy integer scalar (0-d integer arrays too), never a bool."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    return (
        isinstance(value, np.ndarray) and value.ndim == 0 and np.issubdtype(value.dtype, np.integer)
    )


def _axes_type_error(fn, axes, element=None, arg="axes"):
    message = f"{fn}: {arg} must be an int or a sequence of ints; got {arg}={_show(axes)}"
    if element is not None:
        message += f" (element {_show(element)} is a {type(element).__name__})"
    return TypeError(message)


def _as_ints(axes, fn, arg="axes"):
    """The axes as a tuple of Python ints, in the order given; TypeError if not ints."""
    if _is_int(axes):
        return (int(axes),)
    if isinstance(axes, np.ndarray):
        if axes.ndim != 1 or (axes.size and not np.issubdtype(axes.dtype, np.integer)):
            raise _axes_type_error(fn, axes, arg=arg)
        return tuple(int(a) for a in axes)
    if isinstance(axes, (list, tuple, range)):
        for a in axes:
            if not _is_int(a):
                raise _axes_type_error(fn, axes, a, arg)
        return tuple(int(a) for a in axes)
    raise _axes_type_error(fn, axes, arg=arg)


def canonical_axes(axes, ndim, fn="moments", arg="axes"):
    """The reduced axes as a sorted tuple of non-negative ints.

    Args:
      axes: None (all axes), an int (Python or numpy, not bool), a list, tuple
        or range of such ints, or a 1-D (or 0-d) numpy integer array.
        Negative axes count from the end.
      ndim: the rank of the input, a non-negative int.
      fn: the public function's name, the prefix of error messages.
      arg: the argument's name in error messages ("axis" for the jnp and
        tf.math drop-ins).

    Raises:
      TypeError: axes is not one of the above (floats, strings, bools, nested
        sequences, other objects); the message names the value.
      ValueError: an axis is out of range for the rank, or an axis repeats.

    >>> canonical_axes([-1, 0], 3)
    (0, 2)
    >>> canonical_axes(None, 2)
    (0, 1)
    >>> canonical_axes(1.5, 2)
    Traceback (most recent call last):
    ...
    TypeError: moments: axes must be an int or a sequence of ints; got axes=1.5
    """
    ndim = int(ndim)
    if axes is None:
        return tuple(range(ndim))
    given = _as_ints(axes, fn, arg)
    out = []
    for a in given:
        if not -ndim <= a < ndim:
            raise ValueError(f"{fn}: axis {a} is out of range for an input of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{fn}: {arg} contains a repeated axis; got {arg}={given}")
    return tuple(sorted(out))


def check_ddof(ddof, fn="moments"):
    """ddof as a Python int: a non-negative int (Python or numpy), else ValueError.

    >>> check_ddof(1)
    1
    >>> check_ddof(True)
    Traceback (most recent call last):
    ...
    ValueError: moments: ddof must be a non-negative int; got ddof=True
    """
    if not _is_int(ddof) or ddof < 0:
        raise ValueError(f"{fn}: ddof must be a non-negative int; got ddof={_show(ddof)}")
    return int(ddof)


def out_shape(shape, axes, keepdims):
    """The shape of the statistics of an input of `shape` over canonical `axes`: the
    reduced dimensions dropped (kept as 1 with keepdims); other dimensions as given."""
    if keepdims:
        return tuple(1 if a in axes else d for a, d in enumerate(shape))
    return tuple(d for a, d in enumerate(shape) if a not in axes)
