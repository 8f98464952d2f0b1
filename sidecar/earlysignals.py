"""The signals ``kvguard run`` collects, blocked at its first instruction (stdlib only).

As PID 1 the kernel drops a signal whose disposition is the default, so a SIGTERM that
arrives while Python is still importing would be lost, and the pod would wait out its
grace period. ``kvguard.sidecar.cli`` therefore calls :func:`block` before any other
import when its first argument is ``run``: from then on every signal in
:data:`COLLECTED` stays pending until the supervisor collects it with
``signal.sigtimedwait``. :func:`original_mask` is the mask from before, which the child
gets back (``posix_spawn(setsigmask=...)``).
"""

from __future__ import annotations

import signal

__all__ = ["COLLECTED", "FORWARDED", "STOP_SIGNALS", "block", "original_mask"]

#: Signals that request a stop: forwarded, remembered, and start the grace clock.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
#: Every signal forwarded to the main child.
FORWARDED = STOP_SIGNALS | {signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH}
#: What the supervisor collects: the forwarded signals and SIGCHLD.
COLLECTED = FORWARDED | {signal.SIGCHLD}

_original: frozenset[int] | None = None


def block() -> frozenset[int]:
    """Block :data:`COLLECTED` in this (main) thread; idempotent. Returns the mask from
    before the first call."""
    global _original
    if _original is None:
        _original = frozenset(signal.pthread_sigmask(signal.SIG_BLOCK, COLLECTED))
    return _original


def original_mask() -> frozenset[int] | None:
    """The mask from before :func:`block`, or ``None`` when it was never called."""
    return _original
