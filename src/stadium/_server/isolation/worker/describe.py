"""Ask a sandboxed process what an env is, for ``--untrusted-env-code`` (the worker's side of
:mod:`..remote`): a throwaway template, one process, one ``describe`` (:func:`describe_remote`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses

from stadium._errors import ConfigError, StadiumError, TargetError
from stadium._server.isolation import wire
from stadium._server.isolation.remote import Description, decode_description
from stadium._server.isolation.worker.isolation import Isolation
from stadium._server.isolation.worker.template_host import TEMPLATE_START_S, IsolationConfig


def describe_remote(settings: IsolationConfig) -> Description:
    """Ask a sandboxed session process for the env's :class:`Description`: a throwaway
    template (no network, no warm pool) and one process, ended before this returns.
    Blocks the caller (on an event loop of its own, in a thread when the caller's own
    runs) for at most the template's start and one call's limit.

    Raises:
        TargetError: the env could not be imported or compiled in its sandbox.
        ConfigError: no answer in time, or one past the limits.
    """
    limits = dataclasses.replace(settings.limits, network="none", allowed_hosts=())
    settings = dataclasses.replace(settings, warm_pool=0, limits=limits)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_describe(settings))
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="stadium-describe") as pool:
        return pool.submit(asyncio.run, _describe(settings)).result()


async def _describe(settings: IsolationConfig) -> Description:
    isolation = Isolation(settings)
    if isolation.cgroups is not None:  # apart from the worker's own in this process
        isolation.cgroups.tag = "d" + isolation.cgroups.tag
    try:
        try:
            proc = await asyncio.wait_for(isolation.acquire(), TEMPLATE_START_S)
        except StadiumError as exc:
            raise TargetError(
                f"--untrusted-env-code: no sandboxed process to describe the env: {exc}",
                target=settings.target,
            ) from None
        except TimeoutError:
            raise ConfigError(
                f"--untrusted-env-code: no sandboxed env process in {TEMPLATE_START_S:g} s"
            ) from None
        try:
            body = wire.encode(wire.Describe())
            reply = await asyncio.wait_for(
                proc.request(body, wire.DESCRIBE_REPLY), settings.limits.call_timeout
            )
        except TimeoutError:
            raise ConfigError(
                f"--untrusted-env-code: the env did not describe itself within "
                f"{settings.limits.call_timeout:g} s (--step-timeout)"
            ) from None
        except Exception:  # its process died (e.g. its import ended it)
            raise TargetError(
                "--untrusted-env-code: the env's process ended while importing the env "
                "(in its sandbox)",
                target=settings.target,
            ) from None
        finally:
            isolation.release(proc)
        if isinstance(reply, wire.Raised):
            raise TargetError(
                f"loading {settings.target!r} in its sandbox failed: {reply.message[:2000]}",
                target=settings.target,
            )
        return decode_description(reply.description)
    finally:
        isolation.shutdown()
