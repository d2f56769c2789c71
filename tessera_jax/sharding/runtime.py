"""``ts.dist.initialize``: join a multi-process run through JAX's own runtime.

Every process of a run calls ``ts.dist.initialize()`` before any JAX computation;
``jax.distributed`` then connects it to the coordinator (process 0), after which
``jax.devices()`` lists the devices of every process and a mesh may span them all.
Collectives between processes are NCCL's on GPUs and gloo's on CPUs, which is why
multi-process runs work on a machine without GPUs.

Where the run's shape comes from, first match wins per argument:

1. the explicit arguments;
2. the variables ``tessera-launch`` (``tessera_jax/launch/process.py``) gives its children:
   ``TESSERA_COORDINATOR``, ``TESSERA_NUM_PROCESSES``, ``TESSERA_PROCESS_ID`` and
   ``TESSERA_DEVICES_PER_PROC``;
3. JAX's cluster detection (SLURM, Open MPI, Cloud TPU), which
   ``jax.distributed.initialize`` runs for whatever is still unset.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

from tessera_jax import _compat

__all__ = ["LAUNCH_ENV", "initialize"]

#: The variables tessera-launch sets in each child, read by ``initialize()``.
LAUNCH_ENV = (
    "TESSERA_COORDINATOR",
    "TESSERA_NUM_PROCESSES",
    "TESSERA_PROCESS_ID",
    "TESSERA_DEVICES_PER_PROC",
)

_FN = "ts.dist.initialize"


def _check_int(name: str, value: object, low: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_FN}: {name}={value!r} must be an int >= {low}")
    if value < low:
        raise ValueError(f"{_FN}: {name}={value!r} must be an int >= {low}")
    return value


def _check_address(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{_FN}: coordinator_address={value!r} must be a 'host:port' string")
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{_FN}: coordinator_address={value!r} must be 'host:port' with a port in [1, 65535]"
        )
    return value


def _env_int(name: str, low: int) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low:
        raise ValueError(f"{_FN}: the environment's {name}={raw!r} must be an int >= {low}")
    return value


def _launcher_env() -> tuple[str | None, int | None, int | None, list[int] | None]:
    """The run's shape as tessera-launch describes it (all None outside the launcher)."""
    address = os.environ.get("TESSERA_COORDINATOR")
    if address is None:
        return None, None, None, None
    try:
        _check_address(address)
    except ValueError:
        raise ValueError(
            f"{_FN}: the environment's TESSERA_COORDINATOR={address!r} must be 'host:port'"
        ) from None
    num = _env_int("TESSERA_NUM_PROCESSES", 1)
    pid = _env_int("TESSERA_PROCESS_ID", 0)
    per = _env_int("TESSERA_DEVICES_PER_PROC", 1)
    if num is None or pid is None:
        raise ValueError(
            f"{_FN}: TESSERA_COORDINATOR is set but TESSERA_NUM_PROCESSES or "
            "TESSERA_PROCESS_ID is not (tessera-launch sets all three)"
        )
    # The launcher's processes share one host: process i owns local GPUs [i*K, (i+1)*K).
    ids = None if per is None else list(range(pid * per, (pid + 1) * per))
    return address, num, pid, ids


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    initialization_timeout: int = 300,
) -> None:
    """Joins this process to a multi-process run (``jax.distributed.initialize``).

    Call it once per process, before any JAX computation (the backend must not have
    started: it is then built with every process's devices). On the CPU, cross-process
    collectives use gloo unless ``jax_cpu_collectives_implementation`` names another.

    **Arguments:**

    - ``coordinator_address``: ``"host:port"`` of process 0's coordinator service.
    - ``num_processes``: how many processes the run has (>= 1).
    - ``process_id``: this process's rank, in ``[0, num_processes)``.
    - ``local_device_ids``: the local GPUs this process uses (default: tessera-launch's
      ``--devices-per-proc`` share, or what JAX's cluster detection chooses).
    - ``initialization_timeout``: seconds to wait for every process to connect.

    Arguments left as None come from tessera-launch's ``TESSERA_*`` variables, else
    from JAX's detection of SLURM or Open MPI (e.g. under ``srun``).
    """
    coordinator_address = _check_address(coordinator_address)
    num_processes = _check_int("num_processes", num_processes, 1)
    process_id = _check_int("process_id", process_id, 0)
    if isinstance(local_device_ids, int):
        local_device_ids = [local_device_ids]
    if local_device_ids is not None:
        if (
            isinstance(local_device_ids, str)
            or not isinstance(local_device_ids, Sequence)
            or not local_device_ids
        ):
            raise TypeError(
                f"{_FN}: local_device_ids={local_device_ids!r} must be an int or a "
                "non-empty sequence of ints >= 0"
            )
        for i in local_device_ids:
            _check_int("local_device_ids entry", i, 0)
        local_device_ids = list(local_device_ids)
    _check_int("initialization_timeout", initialization_timeout, 1)

    env_address, env_num, env_pid, env_ids = _launcher_env()
    coordinator_address = coordinator_address or env_address
    num_processes = num_processes if num_processes is not None else env_num
    process_id = process_id if process_id is not None else env_pid
    local_device_ids = local_device_ids if local_device_ids is not None else env_ids
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(f"{_FN}: process_id={process_id} must be in [0, {num_processes=})")

    if jax.distributed.is_initialized():
        raise RuntimeError(f"{_FN}: this process has already joined a run (called twice?)")
    if _compat.backends_started():
        raise RuntimeError(
            f"{_FN}: must run before any JAX computation (jax.devices(), device_put, jit "
            "...): a backend that has started cannot see the other processes' devices"
        )
    # Without a CPU collectives implementation, processes on the CPU could not reduce
    # across each other; gloo needs nothing installed. A user's choice (mpi) is kept.
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address,
            num_processes,
            process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=initialization_timeout,
        )
    except ValueError as e:
        unset = [
            name
            for name, value in (
                ("coordinator_address", coordinator_address),
                ("num_processes", num_processes),
                ("process_id", process_id),
            )
            if value is None
        ]
        if not unset:
            raise
        # JAX's cluster detection found nothing to fill the arguments still unset.
        raise ValueError(
            f"{_FN}: no run to join: {', '.join(unset)} not given, no TESSERA_* variables "
            f"(tessera-launch) and no SLURM or Open MPI environment detected ({e}). Pass "
            "coordinator_address, num_processes and process_id, start the processes with "
            "tessera-launch, or run under srun or mpirun"
        ) from e
