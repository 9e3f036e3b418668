"""Correctly rounded mean and variance in JAX: the reference kernel and jnp drop-ins."""

from jax_kernel._functions import mean, std, var
from jax_kernel._moments import moments

__all__ = ["mean", "moments", "std", "var"]
