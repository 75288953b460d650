"""The server, in rooms (docs/ARCHITECTURE.md has the floor plan).

``transports/`` holds the I/O layers (picows + h11, the ASGI app, the worker hand-off); the
rest never speaks a wire library. ``processes/`` holds the supervisor and the worker,
``http/`` the routes and what an upgrade opens, ``sessions/`` a session and its halves,
``admission/`` the door and the slots, ``durability/`` the durable sessions' records and store,
``isolation/`` the env processes, ``images/`` the node's image cache, ``ledger/`` the episode
ledger. Nothing here is imported by the clients.
"""
