"""tessera_jax: the Tessera programming model (operator / tile / mesh) on JAX.

``import tessera_jax as ts``. This file only re-exports; see docs/ARCHITECTURE.md.
"""

import math as _math

from tessera_jax import op as op
from tessera_jax._config import get_kernel_mode as get_kernel_mode
from tessera_jax._config import kernel_mode as kernel_mode
from tessera_jax._config import set_kernel_mode as set_kernel_mode
from tessera_jax.numerics.dtypes import DType as DType
from tessera_jax.numerics.dtypes import Policy as Policy
from tessera_jax.numerics.dtypes import accum as accum
from tessera_jax.numerics.dtypes import bf16 as bf16
from tessera_jax.numerics.dtypes import complex64 as complex64
from tessera_jax.numerics.dtypes import f16 as f16
from tessera_jax.numerics.dtypes import f32 as f32
from tessera_jax.numerics.dtypes import f64 as f64
from tessera_jax.numerics.dtypes import fp6_e3m2 as fp6_e3m2
from tessera_jax.numerics.dtypes import fp8_e4m3 as fp8_e4m3
from tessera_jax.numerics.dtypes import fp8_e5m2 as fp8_e5m2
from tessera_jax.numerics.dtypes import int8 as int8
from tessera_jax.numerics.dtypes import int32 as int32
from tessera_jax.numerics.dtypes import loss_scale as loss_scale
from tessera_jax.numerics.dtypes import stochastic_round as stochastic_round
from tessera_jax.op import abs as abs
from tessera_jax.op import exp as exp
from tessera_jax.op import gelu as gelu
from tessera_jax.op import max as max
from tessera_jax.op import mse as mse
from tessera_jax.op import relu as relu
from tessera_jax.op import round as round
from tessera_jax.op import sqrt as sqrt
from tessera_jax.op import sum as sum
from tessera_jax.op import tanh as tanh

fp6 = fp6_e3m2
pi = _math.pi

__version__ = "0.1.0"
