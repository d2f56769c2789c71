"""Which implementation runs a deterministic all-reduce: a kernel, or an XLA algorithm.

The all-reduce kernels speak the package's kernel vocabulary: ``supports(spec, avals)``,
``prefer(spec, avals)``, ``hardware(platform)``, ``interpretable`` and
``fn(spec, x, interpret=...)``, where ``spec`` is the :class:`AllReduceSpec` decoded
once from the primitive's parameters. :func:`select_kernel` applies the
``TESSERA_KERNELS`` modes to them exactly as ``primitives._core.Operator.select`` does
for every other operator:

* ``xla``: no kernel;
* ``pallas``: the first kernel that supports the case, compiled, on its platforms and
  hardware;
* ``auto``: the same, and the kernel's ``prefer`` (unless ``algo`` named the kernel);
* ``interpret``: the first supporting ``interpretable`` kernel, in an interpreter, on
  any platform. The NVLink kernel is not interpretable (the Mosaic GPU interpreter has
  no peer references or cross-device semaphores), so in interpret mode every
  all-reduce takes its XLA algorithm: there is no all-reduce kernel to interpret.

A kernel is only considered where ``algo`` is ``"auto"`` or the kernel's own name; an
XLA algorithm named by ``algo`` always runs as named.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tessera_jax._config import get_kernel_mode
from tessera_jax.pallas_kernels import allreduce_mgpu
from tessera_jax.primitives._core import Kernel


@dataclasses.dataclass(frozen=True)
class AllReduceSpec:
    """The static parameters of one all-reduce, as its kernels see them.

    Attributes:
      axes: the bound mesh axes reduced over.
      op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
      algo: the requested algorithm (``api.ALGOS``).
      deterministic: whether the result must be the canonical tree.
      n: the number of parts along ``axes``.
    """

    axes: tuple[str, ...]
    op: str
    algo: str
    deterministic: bool
    n: int


NVLINK = Kernel.from_module("nvlink", allreduce_mgpu, allreduce_mgpu.fn)

# The all-reduce kernels, in the order dispatch tries them.
KERNELS: tuple[Kernel, ...] = (NVLINK,)


def select_kernel(
    spec: AllReduceSpec, avals: Sequence[Any], platform: str | None
) -> tuple[Kernel, bool] | None:
    """``(kernel, interpret)`` for the kernel that runs this all-reduce, or None for the
    XLA algorithms (module docstring). ``platform`` None (a lowering for several
    platforms at once) takes XLA, as every operator does."""
    mode = get_kernel_mode()
    if mode == "xla" or platform is None:
        return None
    for k in KERNELS:
        if spec.algo not in ("auto", k.name):
            continue
        if k.unavailable(mode, platform) is not None or k.supports(spec, avals) is not None:
            continue
        if mode == "auto" and spec.algo == "auto" and k.prefer is not None:
            if not k.prefer(spec, avals):
                continue
        return k, mode == "interpret"
    return None
