"""``ts.op``: every Tessera operator (each a JAX primitive named ``ts_<name>``)."""

from tessera_jax.primitives._core import OPERATORS as OPERATORS
from tessera_jax.primitives.elementwise import abs as abs
from tessera_jax.primitives.elementwise import exp as exp
from tessera_jax.primitives.elementwise import gelu as gelu
from tessera_jax.primitives.elementwise import relu as relu
from tessera_jax.primitives.elementwise import round as round
from tessera_jax.primitives.elementwise import sqrt as sqrt
from tessera_jax.primitives.elementwise import tanh as tanh
from tessera_jax.primitives.reductions import max as max
from tessera_jax.primitives.reductions import mse as mse
from tessera_jax.primitives.reductions import sum as sum
