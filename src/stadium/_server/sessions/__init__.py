"""Sessions: :mod:`.runner` runs one env for one client over the protocol core; its halves are
:mod:`.episodes` (the ledger's accounts), :mod:`.forking` (``fork``), :mod:`.resumable`
(resume, restore, persist) and :mod:`.mcp_methods` (OpenEnv's session methods);
:mod:`.reattach` resumes a session on a new connection."""
