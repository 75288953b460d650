"""What the server answers over HTTP and its upgrades, shared by every transport.

:mod:`.endpoints` serves the plain-HTTP routes, :mod:`.openenv_routes` OpenEnv's web interface
and Task API, :mod:`.recordings` the recorded episodes; :mod:`.upgrade` opens what an accepted
WebSocket upgrade asks for: a session, a batch (:mod:`.batch_socket`), ``/mcp``
(:mod:`.mcp_socket`) or ``/harness`` (:mod:`.harness_socket`).
"""
