"""The server's processes: :mod:`.supervisor` forks and watches the workers (``--workers N``),
:mod:`.worker` builds one worker's serving parts, :mod:`.watchdog` watches its event loop,
memory and threads."""
