"""tessera_jax: the Tessera programming model (operator / tile / mesh) on JAX.

``import tessera_jax as ts``. This file only re-exports; see docs/ARCHITECTURE.md.
"""

import math as _math

from tessera_jax import autotune as autotune
from tessera_jax import checkpoint_policies as checkpoint_policies
from tessera_jax import graph as graph
from tessera_jax import launch as launch
from tessera_jax import op as op
from tessera_jax import profiling as profiling
from tessera_jax import stream as stream
from tessera_jax import tile as tile
from tessera_jax._config import get_kernel_mode as get_kernel_mode
from tessera_jax._config import kernel_mode as kernel_mode
from tessera_jax._config import set_kernel_mode as set_kernel_mode
from tessera_jax.autodiff import autodiff as autodiff
from tessera_jax.autodiff import custom_jvp as custom_jvp
from tessera_jax.autodiff import custom_vjp as custom_vjp
from tessera_jax.autodiff import grad as grad
from tessera_jax.autodiff import jit as jit
from tessera_jax.autodiff import value_and_grad as value_and_grad
from tessera_jax.numerics.annotations import Tensor as Tensor
from tessera_jax.numerics.context import accumulation as accumulation
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
from tessera_jax.numerics.policy import QuantizedTensor as QuantizedTensor
from tessera_jax.numerics.policy import dequantize as dequantize
from tessera_jax.numerics.policy import precision_policy as precision_policy
from tessera_jax.numerics.policy import quantize as quantize
from tessera_jax.op import abs as abs
from tessera_jax.op import all_gather as all_gather
from tessera_jax.op import all_reduce as all_reduce
from tessera_jax.op import all_to_all as all_to_all
from tessera_jax.op import cast as cast
from tessera_jax.op import exp as exp
from tessera_jax.op import fft as fft
from tessera_jax.op import flash_attention as flash_attention
from tessera_jax.op import fused_mlp as fused_mlp
from tessera_jax.op import gelu as gelu
from tessera_jax.op import gemm as gemm
from tessera_jax.op import ifft as ifft
from tessera_jax.op import layernorm as layernorm
from tessera_jax.op import linear as linear
from tessera_jax.op import log_softmax as log_softmax
from tessera_jax.op import matmul as matmul
from tessera_jax.op import max as max
from tessera_jax.op import mse as mse
from tessera_jax.op import reduce_scatter as reduce_scatter
from tessera_jax.op import relu as relu
from tessera_jax.op import rmsnorm as rmsnorm
from tessera_jax.op import rmsnorm_matmul as rmsnorm_matmul
from tessera_jax.op import rmsnorm_safe as rmsnorm_safe
from tessera_jax.op import round as round
from tessera_jax.op import scatter as scatter
from tessera_jax.op import softmax as softmax
from tessera_jax.op import sqrt as sqrt
from tessera_jax.op import sum as sum
from tessera_jax.op import tanh as tanh
from tessera_jax.profiling import profile as profile
from tessera_jax.sharding import array as array
from tessera_jax.sharding import dist as dist
from tessera_jax.sharding import domain as domain
from tessera_jax.sharding.launch import index_launch as index_launch
from tessera_jax.sharding.regions import Region as Region
from tessera_jax.sharding.regions import read as read
from tessera_jax.sharding.regions import reduce_sum as reduce_sum
from tessera_jax.sharding.regions import write as write
from tessera_jax.sharding.spec import ShardSpec as ShardSpec
from tessera_jax.tile.kernel import ceil_div as ceil_div
from tessera_jax.tile.kernel import kernel as kernel
from tessera_jax.tile.kernel import mut as mut

fp6 = fp6_e3m2
pi = _math.pi

__version__ = "0.1.0"
