"""The ``stadium`` command and the author tools behind it (check, init, demo)."""
