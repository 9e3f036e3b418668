"""Correctly rounded mean and variance in JAX: the reference kernel."""

from jax_kernel._moments import moments

__all__ = ["moments"]
