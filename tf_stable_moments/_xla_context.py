"""Whether the graph being built is compiled by XLA as a whole (tf.function(jit_compile=True)).

TensorFlow marks such a trace with an ``XLAControlFlowContext``: when a
``tf.function(jit_compile=True)`` is called (or traced), it enters one on the
graph current at the call site, unless that graph or one of its outer graphs is
already in one (``OptionalXlaContext`` in polymorphic_function.py).  The
FuncGraph then traced has that graph as its ``outer_graph``; the graphs of
nested tf.functions, ``tf.cond`` branches and ``tf.while_loop`` bodies chain
to it through ``outer_graph`` too.  ``control_flow_util.GraphOrParentsInXlaContext``
walks that chain; it is what TensorFlow itself uses to decide whether a nested
jit_compile function is compiled on its own.  Keras 3's ``fit``/``evaluate``/
``predict`` with ``jit_compile=True`` wrap the step in such a tf.function.

Limitation (TensorFlow's function cache): the XLA context is not part of the
cache key of a plain tf.function.  A plain tf.function first traced outside any
XLA context and later called inside a jit_compile function reuses that first
trace (traced with ``in_xla_context() == False``), and the other way round.
Such a trace holds the kernel of the other side: the native op StableMoments,
which XLA cannot compile, or XlaCustomCallV2 (the native kernel as an XLA custom
call), which runs only inside XLA; either fails with TensorFlow's message that
no kernel supports the op.  Trace the function in the context it runs in.
"""

from tensorflow.python.eager import context as _context
from tensorflow.python.framework import ops as _ops

try:
    from tensorflow.python.ops.control_flow_util import (
        GraphOrParentsInXlaContext as _graph_or_parents_in_xla_context,
    )
except ImportError:  # pragma: no cover - a TensorFlow without the helper
    _graph_or_parents_in_xla_context = None

__all__ = ["in_xla_context"]


def _walk(graph):
    """GraphOrParentsInXlaContext, from the graph API alone."""
    while graph is not None:
        ctxt = graph._get_control_flow_context()  # noqa: SLF001
        while ctxt is not None:
            if ctxt.IsXLAContext():
                return True
            ctxt = ctxt.outer_context
        graph = getattr(graph, "outer_graph", None)
    return False


def in_xla_context() -> bool:
    """True while building a graph that XLA compiles as a whole.

    True inside ``tf.function(jit_compile=True)``, in plain tf.functions,
    ``tf.cond`` branches and ``tf.while_loop`` bodies traced from one, and in
    Keras train/test/predict steps compiled with ``jit_compile=True``.  False
    in eager mode (also under ``tf.init_scope()`` inside a jit_compile trace),
    in plain tf.function graphs and in TF1 graphs.

    >>> in_xla_context()
    False
    """
    if _context.executing_eagerly():
        return False
    graph = _ops.get_default_graph()
    try:
        if _graph_or_parents_in_xla_context is not None:
            return bool(_graph_or_parents_in_xla_context(graph))
        return _walk(graph)
    except AttributeError:  # pragma: no cover - graph internals changed
        return False
