"""Several registry server processes behind one port (``KVBRIDGE_REGISTRY_SERVE_PROCESSES``).

A lookup costs the registry ~0.2 ms of CPU, most of it grpc.aio's own per-call work, so one Python process
serves about one core's worth of lookups. N worker processes bind the same port with SO_REUSEPORT (the kernel
spreads incoming connections over them); each is a full replica with its own etcd-watch-fed index, group-commit
batcher and engine sweeper, agreeing with the others through etcd's compare-and-swap like separate replicas do.

This parent process holds no gRPC or store state: it starts the workers, restarts one that dies (backing off
while they keep dying young) and passes SIGTERM / SIGINT on to all of them.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from kvbridge.backoff import Backoff

log = logging.getLogger(__name__)

WORKER_FLAG = "--serve-worker"
_POLL_S = 0.2
_FIRST_RESTART_DELAY_S = 1.0
_MAX_RESTART_DELAY_S = 30.0
_YOUNG_S = 10.0  # a worker dying sooner than this after its start doubles the next restart delay
_STOP_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM when the supervisor dies, so no worker outlives it unseen."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: workers then outlive a killed parent
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class _Worker:
    def __init__(self, index: int, argv: Sequence[str]) -> None:
        self.index = index
        self.argv = list(argv)
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.restart_delays = Backoff(_FIRST_RESTART_DELAY_S, _MAX_RESTART_DELAY_S)
        self.restart_at: float | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge_services.registry", *self.argv, WORKER_FLAG, str(self.index)],
            preexec_fn=_die_with_parent,  # safe: this parent runs no threads (no gRPC, no store)
        )
        self.started = time.monotonic()
        self.restart_at = None
        log.info("registry worker %d started (pid %d)", self.index, self.proc.pid)

    def check(self, now: float) -> None:
        """Schedules a restart of a worker that exited; performs a due one."""
        if self.restart_at is not None:
            if now >= self.restart_at:
                self.start()
            return
        code = self.proc.poll() if self.proc is not None else None
        if code is None:
            return
        delay_s = self.restart_delays.next_delay()
        if now - self.started >= _YOUNG_S:  # it ran a while: the restart after its next death is prompt again
            self.restart_delays.reset()
        log.error(
            "registry worker %d (pid %d) exited with %s; restarting in %.0f s",
            self.index,
            self.proc.pid if self.proc else -1,
            code,
            delay_s,
        )
        self.restart_at = now + delay_s

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)


def supervise(count: int, argv: Sequence[str] = ()) -> int:
    """Runs ``count`` workers (each given the parent's flags ``argv``) until SIGTERM / SIGINT, then stops them;
    the process's exit code."""
    workers = [_Worker(i, argv) for i in range(count)]
    stopping: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        for worker in workers:
            worker.signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for worker in workers:
        worker.start()
    while not stopping:
        now = time.monotonic()
        for worker in workers:
            worker.check(now)
        time.sleep(_POLL_S)
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for worker in workers:
        worker.signal(signal.SIGTERM)  # again: one (re)started after the signal arrived
    for worker in workers:
        if worker.proc is None:
            continue
        try:
            worker.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("registry worker %d did not stop in time: killing it", worker.index)
            worker.proc.kill()
            worker.proc.wait()
    return 0
