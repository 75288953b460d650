"""The pure protocol core: bytes and values in, decisions and bytes out.

No sockets, no event loop, no clock of its own: every module here is tested with literal
inputs, and every transport (picows, h11, ASGI) and every client asks it the same questions.
"""
