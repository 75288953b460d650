"""``python -m stadium``: the same as the ``stadium`` command."""

from stadium._cli.main import main

main()
