"""Write the one-line cause of ``kvguard run``'s exit to the termination-message file.

Kubernetes shows the contents of ``terminationMessagePath`` (default
``/dev/termination-log``) in ``kubectl describe pod`` under "Last State" and caps it at
4096 bytes. Outside Kubernetes the file usually does not exist or is not writable: the
write is then skipped quietly (a debug log, never an error), because a supervisor must
not fail its exit over a diagnostic.
"""

from __future__ import annotations

import logging
from pathlib import Path

__all__ = ["MAX_BYTES", "format_message", "write_termination_message"]

#: Kubernetes reads at most 4096 bytes of the termination message.
MAX_BYTES = 4096

_log = logging.getLogger(__name__)


def format_message(cause: str) -> bytes:
    """One line (newlines collapsed), UTF-8, cut to :data:`MAX_BYTES` including ``\\n``."""
    line = " ".join(cause.split())
    data = line.encode("utf-8", "replace")
    if len(data) > MAX_BYTES - 1:
        data = data[: MAX_BYTES - 4].decode("utf-8", "ignore").encode() + b"..."
    return data + b"\n"


def write_termination_message(path: Path | None, cause: str) -> bool:
    """Write ``cause`` to ``path`` (truncating it). Returns ``True`` when written,
    ``False`` when ``path`` is ``None``, cannot be written, or is a file under ``/dev``
    that does not exist (outside Kubernetes). Never raises."""
    if path is None:
        return False
    if not path.exists() and path.parent == Path("/dev"):
        # Kubernetes creates and mounts the file; never create one in /dev ourselves.
        _log.debug("termination log %s does not exist; skipped", path)
        return False
    try:
        with open(path, "wb") as f:
            f.write(format_message(cause))
        return True
    except OSError as e:
        _log.debug("termination log %s not written: %s", path, e)
        return False
