"""``tessera-launch``: start a multi-process run on this machine.

``python -m tessera_jax.launch --nproc N [--devices-per-proc K] (script.py | -m module) [args…]``
starts N copies of the program, each in its own process group, with a coordinator
address on 127.0.0.1 and a free port. Each child finds its rank and the run's shape in
``TESSERA_*`` variables, which ``ts.dist.initialize()`` reads; ``JAX_NUM_CPU_DEVICES``
gives it K virtual CPU devices, and on GPUs ``initialize`` gives process i the local
GPUs ``[i*K, (i+1)*K)``.

Every line a child writes comes out prefixed with ``[rank i]`` (stdout to stdout,
stderr to stderr). When a child exits non-zero or dies, the launcher terminates the
other process groups (SIGTERM, then SIGKILL after a grace period), names the failed
rank and its status, and exits non-zero: a dead peer would otherwise leave the others
blocked in a collective until JAX's heartbeat timeout. SIGINT or SIGTERM to the
launcher terminates the children the same way.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

__all__ = ["main"]

PROG = "tessera-launch"
#: Seconds a child gets between SIGTERM and SIGKILL once the run is being torn down. JAX's
#: preemption service takes SIGTERM as a notice, so a JAX child often needs the SIGKILL.
GRACE_S = 5.0
_POLL_S = 0.05


class _Stop(Exception):
    """Raised in the main thread by a SIGINT/SIGTERM sent to the launcher."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --nproc N [--devices-per-proc K] (script.py | -m module) [args ...]",
        description="Start N local processes of a multi-process JAX run; each calls "
        "ts.dist.initialize() to join it.",
    )
    p.add_argument("--nproc", metavar="N", required=True, help="number of processes (>= 1)")
    p.add_argument(
        "--devices-per-proc",
        metavar="K",
        default="1",
        help="devices per process: K virtual CPU devices on the CPU, K local GPUs on GPUs "
        "(default 1)",
    )
    return p


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's own options, and the program (``script`` or ``-m module``) with its args.

    argparse alone would take the program's options for the launcher's; the program
    starts at the first token that is neither a launcher option nor its value.
    """
    takes_value = {"--nproc", "--devices-per-proc"}
    own: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "-m" or not tok.startswith("-"):
            return own, list(argv[i:])
        own.append(tok)
        if tok in takes_value and i + 1 < len(argv):
            own.append(argv[i + 1])
            i += 1
        i += 1
    return own, []


def _positive(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise ValueError(f"{name}={raw!r} must be an int >= 1")
    return value


def _command(program: list[str]) -> list[str]:
    if not program:
        raise ValueError("no program given: pass script.py or -m module after the options")
    if program[0] == "-m":
        if len(program) < 2 or not program[1] or program[1].startswith("-"):
            raise ValueError("-m must be followed by a module name (e.g. -m pkg.train)")
        return [sys.executable, "-m", *program[1:]]
    script = program[0]
    if not os.path.isfile(script):
        raise ValueError(f"script={script!r} is not a file")
    return [sys.executable, *program]


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for process 0's coordinator service."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(rank: int, src: IO[bytes], dst: IO[str], lock: threading.Lock) -> None:
    """Copies a child's stream line by line, each line prefixed with the child's rank."""
    for raw in iter(src.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        with lock:
            dst.write(f"[rank {rank}] {line}\n")
            dst.flush()
    src.close()


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by {name} (signal {-code})"
    return f"exited with status {code}"


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # The child leads its own session, so its pid is the group id; the group outlives
    # the child while any process it started is still running.
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every child's process group, then SIGKILL what is left after GRACE_S."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        _signal_group(p, signal.SIGKILL)
        p.wait()


def _run(cmd: list[str], nproc: int, per_proc: int) -> int:
    coordinator = f"127.0.0.1:{_free_port()}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    failed: tuple[int, int] | None = None
    stopped: int | None = None
    try:
        for rank in range(nproc):
            env = dict(os.environ)
            env.update(
                TESSERA_COORDINATOR=coordinator,
                TESSERA_NUM_PROCESSES=str(nproc),
                TESSERA_PROCESS_ID=str(rank),
                TESSERA_DEVICES_PER_PROC=str(per_proc),
                # Read when jax is imported, so the count holds before any backend starts.
                JAX_NUM_CPU_DEVICES=str(per_proc),
                PYTHONUNBUFFERED="1",
            )
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            procs.append(proc)
            for src, dst in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                t = threading.Thread(target=_pump, args=(rank, src, dst, lock), daemon=True)
                t.start()
                pumps.append(t)
        while failed is None:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
            elif all(c == 0 for c in codes):
                break
            else:
                time.sleep(_POLL_S)
    except _Stop as stop:
        stopped = stop.signum
    finally:
        # Also reaps whatever the children started in their sessions after a clean exit.
        _terminate(procs)
        for t in pumps:
            t.join(timeout=GRACE_S)
    if stopped is not None:
        name = signal.Signals(stopped).name
        print(f"{PROG}: received {name}; terminated all {nproc} processes", file=sys.stderr)
        return 128 + stopped
    if failed is not None:
        rank, code = failed
        print(
            f"{PROG}: rank {rank} {_describe(code)}; terminated the other processes",
            file=sys.stderr,
        )
        return code if code > 0 else 128 - code
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launcher on ``argv`` (default ``sys.argv[1:]``); returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, program = _split(argv)
    parser = _parser()
    opts = parser.parse_args(own)
    try:
        nproc = _positive("--nproc", opts.nproc)
        per_proc = _positive("--devices-per-proc", opts.devices_per_proc)
        cmd = _command(program)
    except ValueError as e:
        parser.print_usage(sys.stderr)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2

    stopping: list[int] = []

    def stop(signum, frame):
        # Only the first signal interrupts; later ones must not cut the teardown short.
        if not stopping:
            stopping.append(signum)
            raise _Stop(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run(cmd, nproc, per_proc)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    sys.exit(main())
