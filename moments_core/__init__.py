"""Backend-neutral core shared by tf_stable_moments and jax_kernel.

Imports neither TensorFlow nor JAX at import time (numpy only).
"""

__all__ = []
