"""Which ``--record`` writer a worker starts: the native one
(``native/stadium-record-writer``, a Rust program built beside this module by
``make record-deps`` or the wheel's build hook) or the Python one
(``python -m stadium._server.ledger.writer``). Both read the same stream (:mod:`.pipe`),
write the same shards and report through the same counts.

The native writer is the default; the Python writer serves a ``--record-redact`` hook (the
operator's Python code runs in the writer), ``STADIUM_RECORD_WRITER=python``, and a checkout
or wheel without the native binary (logged once per worker).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("stadium.record")

#: Where the build puts the native writer.
NATIVE = Path(__file__).with_name("stadium-record-writer")
#: ``STADIUM_RECORD_WRITER``: ``native`` (the default) or ``python``.
CHOICE_ENV = "STADIUM_RECORD_WRITER"
_said = False


def writer_command(read_fd: int, counts_fd: int, settings: dict[str, Any]) -> list[str]:
    """The command line of the writer process for ``settings`` (record.py's ``_start``)."""
    global _said
    args = [str(read_fd), str(counts_fd), json.dumps(settings)]
    python = [sys.executable, "-m", "stadium._server.ledger.writer", *args]
    choice = os.environ.get(CHOICE_ENV, "native").strip().lower() or "native"
    if choice == "python" or settings["config"].get("redact"):
        return python
    if choice != "native" or not os.access(NATIVE, os.X_OK):
        if not _said:
            _said = True
            why = (
                f"{CHOICE_ENV}={choice!r} is neither 'native' nor 'python'"
                if choice != "native"
                else f"the native writer {NATIVE} is missing (`make record-deps` builds it)"
            )
            log.warning("--record: %s: the Python writer writes the shards", why)
        return python
    return [str(NATIVE), *args]


__all__ = ["CHOICE_ENV", "NATIVE", "writer_command"]
