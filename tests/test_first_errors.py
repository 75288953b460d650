"""The errors a first-time user meets (a port in use, a typo in a target, an env that
raises under ``stadium check``) say what was wrong and what to do."""

from __future__ import annotations

import socket

import pytest

from stadium._errors import ConfigError
from stadium._server.server import listen_socket


def test_a_port_in_use_says_how_to_pick_another() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            listen_socket("127.0.0.1", port)
    message = str(caught.value)
    assert f"cannot listen on 127.0.0.1:{port}" in message
    assert "Address already in use" in message
    assert "--port 0 picks a free one" in message
