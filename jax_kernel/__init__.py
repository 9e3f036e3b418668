"""Correctly rounded mean and variance in JAX: the kernel, jnp drop-ins, a mergeable state."""

from jax_kernel._centre import standardize
from jax_kernel._functions import mean, std, var
from jax_kernel._state import (
    MomentsState,
    accumulate_state,
    merge_states,
    moments_state,
    state_moments,
)
from jax_kernel._union import moments

__all__ = [
    "MomentsState",
    "accumulate_state",
    "mean",
    "merge_states",
    "moments",
    "moments_state",
    "standardize",
    "state_moments",
    "std",
    "var",
]
