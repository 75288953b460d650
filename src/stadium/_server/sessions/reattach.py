"""Resuming a session on a new connection: this worker's, or one restored from the store.

Both transports call :func:`resume_session` (through :mod:`stadium._server.http.upgrade`)
when the handshake says a ``/ws`` request resumes a session (:mod:`stadium._core.resume`
has the wire extension).
"""

from __future__ import annotations

import logging
import os

from stadium._core.access import Tenant
from stadium._core.protocol import Encoding
from stadium._core.resume import ResumeAsk, Target, unknown_session
from stadium._errors import ResumeError, StadiumError
from stadium._server.runtime import Runtime
from stadium._server.sessions.resumable import Where
from stadium._server.sessions.runner import Session

log = logging.getLogger("stadium.session")


def resume_session(
    runtime: Runtime,
    ask: ResumeAsk,
    target: Target,
    encoding: Encoding,
    where: Where,
    client: str | None = None,
    tenant: Tenant | None = None,
) -> Session | StadiumError:
    """Resume session ``ask.sid`` on the connection ``target``: this worker's, or with
    ``--durable`` one restored from the store (its worker or node gone), a new session
    of ``client`` (the peer that resumes it: its quota, its rate) through the doorway.
    With ``--tenants``, a session of another tenant than ``tenant`` is refused as unknown
    (a resume token does not carry a session across tenants)."""
    sid = ask.sid or ""
    session = runtime.resumable.get(sid)
    if isinstance(session, Session):
        if (session.tenant and session.tenant.name) != (tenant and tenant.name):
            log.debug("resume of %s refused: another tenant's session", ask.sid)
            return unknown_session(ask.sid)  # as if there were none (--tenants)
        error = session.resume(ask, target, where)
        return session if error is None else error
    durable = runtime.durable
    if durable is None or runtime.draining:
        log.debug("resume of %s refused: not held by worker %d", ask.sid, os.getpid())
        return unknown_session(ask.sid)
    record = durable.load(sid, ask.token)
    if isinstance(record, StadiumError):
        return record
    if record.tenant != (tenant and tenant.name):
        log.debug("restore of %s refused: another tenant's session", ask.sid)
        return unknown_session(ask.sid)
    if record.encoding != encoding.value:
        return ResumeError(
            f"session {sid} uses {record.encoding} frames: resume it with the same encoding",
            session=sid,
        )
    # A new id: the old one names a worker that is gone (a later resume must reach this one).
    restored = Session(
        runtime, target, encoding, client=client, resume=(runtime.doors.new_id(), ask.token),
        tenant=tenant,
    )  # fmt: skip
    restored.start_restoring(record, ask, where)
    return restored


__all__ = ["resume_session"]
