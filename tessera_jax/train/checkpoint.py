"""Checkpoints of the demo's training state with orbax: sharded saves, restore onto
any mesh, and detection of corrupt or partial checkpoints.

Each checkpoint holds the state (``StandardSave``: every process writes its own shards)
and a JSON record of the step, the run's settings and the state's fingerprint. A
checkpoint whose state does not read back, or reads back with another fingerprint, is
reported and moved to ``<dir>/corrupt/`` — kept, not deleted — and the next older one
is used. Orbax writes a checkpoint under a temporary name and renames it when complete,
so a run killed while saving leaves no partial checkpoint behind under a step's name.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


def host_value(x: jax.Array | np.ndarray) -> np.ndarray:
    """The whole global value of ``x`` on this host (gathered across processes)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def fingerprint(tree: Any) -> str:
    """SHA-256 (first 16 hex digits) of the leaves' bytes, in tree order."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(host_value(leaf)).tobytes())
    return h.hexdigest()[:16]


class Checkpoints:
    """Saves and restores the training state in ``directory`` (created if missing)."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3):
        self.directory = pathlib.Path(directory).absolute()
        self.keep = keep
        self._manager = self._open()

    def _open(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(create=True, max_to_keep=self.keep),
        )

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Saves ``state`` at ``step`` (blocking until it is complete on disk)."""
        meta = {**meta, "step": step, "fingerprint": fingerprint(state)}
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore_latest(self, abstract_state: Any, log=print) -> tuple[int, Any, dict] | None:
        """``(step, state, meta)`` of the newest checkpoint that reads back intact, laid
        out as ``abstract_state`` (ShapeDtypeStructs with shardings: any mesh); None if
        there is none. Corrupt ones are reported through ``log`` and moved aside."""
        for step in reversed(self.steps()):
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state),
                        meta=ocp.args.JsonRestore(),
                    ),
                )
                state, meta = restored["state"], restored["meta"]
                got = fingerprint(state)
                if got != meta.get("fingerprint"):
                    raise ValueError(
                        f"its state's fingerprint {got} is not the saved {meta.get('fingerprint')}"
                    )
            except Exception as e:  # orbax/tensorstore raise many types for bad files
                log(
                    f"checkpoint {self.directory / str(step)} is corrupt ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:200]}); moving it to corrupt/ and trying an "
                    "older one"
                )
                self._quarantine(step)
                continue
            return step, state, meta
        return None

    def _quarantine(self, step: int) -> None:
        if jax.process_index() == 0:
            dest = self.directory / "corrupt"
            dest.mkdir(exist_ok=True)
            target = dest / str(step)
            n = 1
            while target.exists():
                target, n = dest / f"{step}.{n}", n + 1
            shutil.move(str(self.directory / str(step)), str(target))
        multihost_utils.sync_global_devices(f"tessera_jax checkpoint quarantine {step}")
        self._manager.close()
        self._manager = self._open()

    def close(self) -> None:
        self._manager.close()
