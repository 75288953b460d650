"""The first code a template process runs: ``python -P .../boot.py SETTINGS_FD``.

The worker hands the template its settings (JSON, env kwargs included, which may hold
secrets) in a memfd inherited as ``SETTINGS_FD``, never in argv (every local user reads
``/proc/*/cmdline``) nor in the environment (the initial environment block stays in every
process forked from the template, and in ``/proc/self/environ``, for its life). This
script reads and closes the memfd, puts the worker's ``sys.path`` in place *before* it
imports Stadium (so the template runs the worker's own copy of the code, not whichever
one the interpreter's site-packages names), then runs
:func:`~stadium._server.isolation.template.child.template_main`. Run with ``-P``: the folder of
this file is not put on ``sys.path``. Standard library only, until ``sys.path`` is set.
"""

from __future__ import annotations

import json
import os
import sys

#: The largest settings document read (a bound on what the template allocates for it).
SETTINGS_MAX = 64 * 1024 * 1024


def read_settings(fd: int) -> dict[str, object]:
    """The settings in memfd ``fd`` (closed afterwards)."""
    try:
        size = os.fstat(fd).st_size
        if size > SETTINGS_MAX:
            raise ValueError(f"the template's settings are {size} bytes (at most {SETTINGS_MAX})")
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    settings = json.loads(data)
    if not isinstance(settings, dict):
        raise ValueError("the template's settings are not a JSON object")
    return settings


def main() -> None:
    settings = read_settings(int(sys.argv[1]))
    path = settings.get("sys_path")
    if isinstance(path, list) and path:
        sys.path[:] = [str(p) for p in path]
    from stadium._server.isolation.template.child import template_main

    template_main(settings)


if __name__ == "__main__":
    main()
