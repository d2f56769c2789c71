"""``ts.stream``: seed 000's streams, mapped honestly onto JAX's asynchronous dispatch.

What JAX offers, and so what a stream here is:

* Every call (an operator, a jitted function, a transfer) is dispatched asynchronously:
  it returns an array at once, whose value is computed later, and the host only waits
  when it reads a value (or calls ``block_until_ready``).
* Each device runs the computations dispatched to it in dispatch order, on one compute
  stream per device. JAX exposes no other device stream, no priorities and no way to
  make two computations of one device run concurrently; XLA decides any concurrency
  inside one compiled program.
* Copies of host memory to a device (``jax.device_put`` of a NumPy array) run on the
  runtime's host-to-device transfer stream, and so do overlap with computations already
  dispatched to the compute stream; copies between devices use the runtime's transfer
  streams as well; a copy within one device is an operation of its compute stream.

A :class:`Stream` is therefore a host-side handle, not a device stream: it remembers the
arrays that :func:`memcpy_async` produced through it, so that ``synchronize(stream)``
waits for exactly that work. Priorities: JAX runs a device's work in dispatch order
whatever the caller wants, so the one priority that can be honoured is 0, and any other
is refused rather than ignored; fairness between streams is dispatch order (first
dispatched, first run) — there is no weighting to configure.
"""

from __future__ import annotations

import weakref
from typing import Any

import jax
import numpy as np

# The priorities JAX can honour: its single compute stream per device runs work in
# dispatch order (CUDA's stream priorities are not reachable from JAX).
PRIORITIES = (0,)


class Stream:
    """A host-side handle grouping the copies issued through it (see the module docs).

    Attributes:
      device: the device whose work the stream orders (copies through it must target it).
      priority: always 0 (the only priority JAX can honour).
    """

    def __init__(self, device: jax.Device, priority: int):
        self.device = device
        self.priority = priority
        self._pending: list[weakref.ref] = []

    def __repr__(self) -> str:
        return f"ts.stream.Stream(device={self.device}, priority={self.priority})"

    def _issued(self, x: jax.Array) -> None:
        self._pending = [r for r in self._pending if r() is not None]
        self._pending.append(weakref.ref(x))

    def synchronize(self) -> None:
        """Blocks until every copy issued through this stream has completed."""
        jax.block_until_ready([x for x in (r() for r in self._pending) if x is not None])
        self._pending = []


def new(priority: int = 0, *, device: jax.Device | None = None) -> Stream:
    """A new stream for ``device`` (default: ``jax.devices()[0]``).

    ``priority`` must be 0: JAX offers no stream priorities (each device runs its work
    in dispatch order), so another value is refused instead of being silently dropped.
    """
    if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, (int, np.integer)):
        raise TypeError(f"ts.stream.new: {priority=!r} must be an int")
    if int(priority) not in PRIORITIES:
        raise ValueError(
            f"ts.stream.new: {priority=} is not available: JAX runs each device's work on "
            "one compute stream in dispatch order and exposes no stream priorities, so the "
            f"only priority it can honour is {PRIORITIES[0]} (order work by dispatching it "
            "first)"
        )
    if device is None:
        device = jax.devices()[0]
    elif not isinstance(device, jax.Device):
        raise TypeError(f"ts.stream.new: device={device!r} must be a jax.Device")
    return Stream(device, int(priority))


def memcpy_async(*, dst: Any, src: Any, stream: Stream | None = None) -> jax.Array:
    """Copies ``src`` to ``dst``'s placement asynchronously; returns the destination array.

    **Arguments:**

    - ``dst``: where the copy goes: a jax array of ``src``'s shape and dtype (its
      placement is used; jax arrays are immutable, so ``dst`` itself is left unchanged
      and the copy is the returned array), a ``jax.Device`` or a ``jax.sharding.Sharding``.
    - ``src``: a NumPy array (host memory) or a jax array.
    - ``stream``: the stream the copy is issued through (``synchronize(stream)`` waits
      for it); its device must be one of the destination's.

    **Returns:** a new jax array holding a copy of ``src``: later writes to a NumPy
    ``src`` do not reach it (the host memory is copied first: the transfer itself runs
    after this call returns). The call returns before the copy completes; reading the
    result waits for it.
    """
    api = "ts.stream.memcpy_async"
    if stream is not None and not isinstance(stream, Stream):
        raise TypeError(f"{api}: stream={stream!r} must come from ts.stream.new()")
    if isinstance(src, jax.core.Tracer):
        raise TypeError(f"{api}: src is a tracer: copies are issued eagerly, outside jax.jit")
    if not isinstance(src, (jax.Array, np.ndarray)):
        raise TypeError(f"{api}: src={type(src).__name__} must be a NumPy or jax array")
    if isinstance(dst, jax.Array):
        if isinstance(dst, jax.core.Tracer):
            raise TypeError(f"{api}: dst is a tracer: copies are issued eagerly")
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"{api}: dst is {dst.dtype}{list(dst.shape)} but src is "
                f"{src.dtype}{list(src.shape)}; a copy keeps the shape and dtype"
            )
        target = dst.sharding
    elif isinstance(dst, jax.Device):
        target = jax.sharding.SingleDeviceSharding(dst)
    elif isinstance(dst, jax.sharding.Sharding):
        target = dst
    else:
        raise TypeError(
            f"{api}: dst={type(dst).__name__} must be a jax array, a jax.Device or a Sharding"
        )
    if stream is not None and stream.device not in target.device_set:
        raise ValueError(
            f"{api}: the stream belongs to {stream.device}, but the destination is on "
            f"{sorted(target.device_set, key=lambda d: d.id)}; use a stream of a "
            "destination device"
        )
    if isinstance(src, np.ndarray):
        # The runtime may read host memory after this call returns (the transfer is
        # asynchronous): copy it first, so that later writes to ``src`` cannot reach ``out``.
        out = jax.device_put(np.array(src, copy=True), target)
    else:
        out = jax.device_put(src, target, may_alias=False)  # a new buffer even when in place
    if stream is not None:
        stream._issued(out)
    return out


def synchronize(stream: Stream | None = None) -> None:
    """Blocks until ``stream``'s copies complete; without a stream, until all dispatched
    work has (every live array of the default backend is ready)."""
    if stream is not None:
        if not isinstance(stream, Stream):
            raise TypeError(
                f"ts.stream.synchronize: stream={stream!r} must come from ts.stream.new()"
            )
        stream.synchronize()
        return
    jax.block_until_ready(jax.live_arrays())
