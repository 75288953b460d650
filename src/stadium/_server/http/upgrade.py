"""What an accepted upgrade opens on its connection: a session, a batch, or a resumed session.

:func:`stadium._core.handshake.negotiate` decides a ``/ws`` request; once the
transport has sent the 101 it calls :func:`open_upgrade` with the connection's
channel, so that picows and the ASGI app open the same things the same way.
"""

from __future__ import annotations

from collections.abc import Callable

from stadium._core.handshake import Upgrade
from stadium._core.protocol import SessionProtocol
from stadium._errors import StadiumError
from stadium._server.http.batch_socket import BatchServerConnection
from stadium._server.http.harness_socket import HarnessSession
from stadium._server.http.mcp_socket import McpSocket
from stadium._server.runtime import CLOSE_POLICY, NODE_NAME, Channel, Runtime
from stadium._server.sessions.reattach import resume_session
from stadium._server.sessions.runner import Session


def open_upgrade(
    runtime: Runtime,
    upgrade: Upgrade,
    channel: Channel,
    *,
    client: str | None,
    address: Callable[[], str],
) -> Session | BatchServerConnection | McpSocket | None:
    """Open what ``upgrade`` names on ``channel``; ``None`` when a resume is refused
    (the client was told why, with ``RESUME_FAILED``, and the connection is closing).

    Args:
        client: the peer's address, for the per-client limits (``None``: no limits).
        address: reads the ``host:port`` the connection reached (a resumable session's
            address, which routers send its resume to).
    """
    if upgrade.resume is not None:
        here = (NODE_NAME, address())
        result = resume_session(
            runtime, upgrade.resume, channel, upgrade.encoding, here, client, upgrade.tenant
        )
        if isinstance(result, StadiumError):
            runtime.errors_total[str(result.code)] += 1
            protocol = SessionProtocol(runtime.spec, upgrade.encoding, str)
            channel.send(protocol.error_reply(None, result))
            channel.close(CLOSE_POLICY, "session cannot be resumed")
            return None
        return result
    if upgrade.mcp:  # OpenEnv's WS /mcp: JSON-RPC frames on a session of its own
        return McpSocket(runtime, channel, client, upgrade.tenant)
    if upgrade.harness:  # OpenEnv's WS /harness: harness turns on a session of its own
        harness = HarnessSession(runtime, channel, client, upgrade.tenant)
        harness.start()
        return harness
    if upgrade.batch:
        where = (NODE_NAME, address()) if upgrade.resumable else None
        return BatchServerConnection(
            runtime, channel, upgrade.encoding, client, where, upgrade.tenant
        )
    session = Session(
        runtime,
        channel,
        upgrade.encoding,
        client=client,
        attach=upgrade.attach,
        resume=upgrade.session,
        tenant=upgrade.tenant,
    )
    session.start()
    return session


__all__ = ["open_upgrade"]
