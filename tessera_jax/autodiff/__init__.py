"""Autodiff: ts.grad / value_and_grad / autodiff / custom_vjp / custom_jvp / jit."""

from tessera_jax.autodiff.api import autodiff as autodiff
from tessera_jax.autodiff.api import custom_jvp as custom_jvp
from tessera_jax.autodiff.api import custom_vjp as custom_vjp
from tessera_jax.autodiff.api import grad as grad
from tessera_jax.autodiff.api import jit as jit
from tessera_jax.autodiff.api import value_and_grad as value_and_grad
