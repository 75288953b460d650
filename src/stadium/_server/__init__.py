"""The server: sessions, the worker's runtime, the processes, and the transports.

``transports/`` holds the I/O layers (picows + h11, the ASGI app, the worker hand-off); the
rest never speaks a wire library. Nothing here is imported by the clients.
"""
