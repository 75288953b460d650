"""Text fit for a terminal: what the CLI prints of values others chose (a recording's
episode ids and env versions, a server's error messages)."""

from __future__ import annotations

import re

#: C0 and C1 control characters, DEL, and the bidirectional overrides: what a terminal
#: would act on (an escape sequence can move the cursor, rewrite lines, set the clipboard).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` fit for a terminal: each control character (but tab and newline) shown as
    its escape (``\\x1b``), so a value printed cannot act on the operator's terminal."""
    return _CONTROL.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


__all__ = ["printable"]
