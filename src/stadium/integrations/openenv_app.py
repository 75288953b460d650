"""Serve an OpenEnv *app* as its author wrote it: ``stadium serve pkg.server.app:app``.

OpenEnv envs are served with ``uvicorn pkg.server.app:app``, where ``app`` is what
``create_app(EnvClass, ActionModel, ObservationModel, env_name=..., max_concurrent_envs=...)``
returned. Many envs give their action model only there (``coding_env``:
``PythonCodeActEnv.step(self, action: Action)``), so the env class alone does not say
what an action is. This module reads what ``create_app`` was given, without starting
OpenEnv's server:

* the FastAPI app holds OpenEnv's ``HTTPEnvServer`` in its startup hooks and route
  closures (:func:`http_server_of`): the env factory, ``action_cls``,
  ``observation_cls``, ``state_cls``, ``env_name`` and the concurrency config;
* the mode (``simulation`` or ``production``) is the one its routes were registered
  for (``POST /reset`` present or not);
* ``max_concurrent_envs`` counts only when the app's author passed it (or a
  ``ConcurrencyConfig``): while the app module is imported by Stadium,
  :func:`recording_servers` notes the arguments each ``HTTPEnvServer`` was built with.
  OpenEnv's own default (1) is not a choice of the author's, so Stadium's applies.

An env *directory* with an ``openenv.yaml`` (``stadium serve envs/coding_env``) names
its app in the manifest's ``app:`` (default ``server.app:app``); see
:func:`manifest_app`.

Requires ``pip install 'stadium-rl[openenv]'``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.abc
import importlib.metadata
import importlib.util
import inspect
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from stadium._errors import TargetError

_HTTP_SERVER = "openenv.core.env_server.http_server"
MANIFEST = "openenv.yaml"
DEFAULT_APP = "server.app:app"

#: What OpenEnv's FastAPI app reports as ``info.version`` for every env (its HTTP API's
#: version; ``openenv validate`` reads it as the ``openenv-http/1.x`` profile).
OPENENV_API_VERSION = "1.0.0"


@dataclasses.dataclass(frozen=True)
class OpenEnvApp:
    """What an OpenEnv app's ``create_app`` (``HTTPEnvServer``) was given.

    Attributes:
        factory: the env factory (a class, or a callable building an instance).
        env_class: the OpenEnv ``Environment`` class the factory builds.
        action_cls, observation_cls, state_cls: the models given to ``create_app``.
        env_name: ``env_name`` (OpenEnv's default: the factory's name).
        max_concurrent_envs: given by the app's author, else ``None``.
        mode: ``simulation`` or ``production``, as the app's routes were registered.
        web: the app serves OpenEnv's web interface (built by ``create_web_interface_app``,
            or by ``create_app`` with ``ENABLE_WEB_INTERFACE`` set): Stadium serves its
            JSON endpoints too, whatever the variable says when Stadium starts.
    """

    factory: Callable[..., Any]
    env_class: type[Any]
    action_cls: type[Any]
    observation_cls: type[Any]
    state_cls: type[Any]
    env_name: str
    max_concurrent_envs: int | None
    mode: str
    web: bool = False


def is_openenv_app(obj: Any) -> bool:
    """Whether ``obj`` looks like a FastAPI app OpenEnv built (never imports openenv)."""
    return sys.modules.get(_HTTP_SERVER) is not None and http_server_of(obj) is not None


def http_server_of(app: Any) -> Any:
    """The ``HTTPEnvServer`` whose routes ``app`` carries, or ``None``.

    Found in the closures of the app's startup hooks (OpenEnv registers its session
    reaper there) and of its route endpoints.
    """
    module = sys.modules.get(_HTTP_SERVER)
    router = getattr(app, "router", None)
    if module is None or router is None:
        return None
    server_cls = module.HTTPEnvServer
    hooks = list(getattr(router, "on_startup", ()))
    hooks += [getattr(route, "endpoint", None) for route in getattr(router, "routes", ())]
    for hook in hooks:
        for cell in getattr(hook, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, server_cls):
                return value
    return None


_GIVEN_ATTR = "_stadium_given"


@contextlib.contextmanager
def recording_servers() -> Iterator[None]:
    """While open, every OpenEnv ``HTTPEnvServer`` built notes the arguments it was
    given (read by :func:`app_settings`).

    Never imports OpenEnv itself (its import takes seconds): when the module is not
    imported yet, a ``sys.meta_path`` hook patches it right after it is, if the code run
    meanwhile (a target's import) imports it.
    """
    undo: list[Callable[[], None]] = []
    module = sys.modules.get(_HTTP_SERVER)
    hook: _PatchOnImport | None = None
    if module is not None:
        undo.append(_patch(module))
    else:
        hook = _PatchOnImport(undo)
        sys.meta_path.insert(0, hook)
    try:
        yield
    finally:
        if hook is not None:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(hook)
        for restore in undo:
            restore()


def _patch(module: Any) -> Callable[[], None]:
    """Make ``module.HTTPEnvServer`` note its arguments; return what undoes it."""
    server_cls = module.HTTPEnvServer
    original = server_cls.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
            given = {k: v for k, v in bound.arguments.items() if k != "self"}
        except TypeError:  # OpenEnv raises its own error for these
            given = {}
        original(self, *args, **kwargs)
        setattr(self, _GIVEN_ATTR, given)

    server_cls.__init__ = init

    def restore() -> None:
        server_cls.__init__ = original

    return restore


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches OpenEnv's ``http_server`` module (:func:`_patch`) once it is executed."""

    def __init__(self, undo: list[Callable[[], None]]) -> None:
        self.undo = undo

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _HTTP_SERVER:
            return None
        sys.meta_path.remove(self)  # once: the real finders find it
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            self.undo.append(_patch(module))

        loader.exec_module = exec_and_patch
        return spec


def app_settings(app: Any, target: str) -> OpenEnvApp:
    """Read what ``create_app`` was given from the FastAPI app ``app``.

    Raises:
        TargetError: ``app`` holds no OpenEnv ``HTTPEnvServer``.
    """
    server = http_server_of(app)
    if server is None:
        raise TargetError(
            f"{target!r} is a {type(app).__name__} without an OpenEnv HTTPEnvServer: serve the "
            "app create_app() returned, or the env class itself",
            target=target,
        )
    given: dict[str, Any] = getattr(server, _GIVEN_ATTR, None) or {}
    max_envs: int | None = None
    config = given.get("concurrency_config")
    if given.get("max_concurrent_envs") is not None:
        max_envs = int(given["max_concurrent_envs"])
    elif config is not None:
        max_envs = int(config.max_concurrent_envs)
    elif _GIVEN_ATTR not in vars(server):  # imported before Stadium could note it
        limit = int(server.max_concurrent_envs)
        max_envs = limit if limit != 1 else None  # 1 is OpenEnv's default, not a choice
    paths = {getattr(route, "path", None) for route in app.router.routes}
    factory = server._env_factory
    return OpenEnvApp(
        factory=factory,
        env_class=env_class_of(factory, target),
        action_cls=server.action_cls,
        observation_cls=server.observation_cls,
        state_cls=server.state_cls,
        env_name=str(server.env_name),
        max_concurrent_envs=max_envs,
        mode="simulation" if "/reset" in paths else "production",
        web="/web/reset" in paths,
    )


def env_class_of(factory: Callable[..., Any], target: str) -> type[Any]:
    """The OpenEnv ``Environment`` class ``factory`` builds: the factory itself, a
    ``functools.partial``'s function, a function's return annotation, else the type of
    one instance built to find out (closed at once)."""
    from openenv.core.env_server.interfaces import Environment

    def env_type(candidate: Any) -> type[Any] | None:
        if isinstance(candidate, type) and issubclass(candidate, Environment):
            return candidate
        return None

    found = env_type(factory)
    if found is None and isinstance(factory, functools.partial):
        found = env_type(factory.func)
    if found is None:
        try:
            found = env_type(typing.get_type_hints(factory).get("return"))
        except Exception:  # unresolvable annotations: build one
            found = None
    if found is None:
        try:
            instance = factory()
        except Exception as exc:
            raise TargetError(
                f"building an env with {target!r}'s factory failed: {type(exc).__name__}: {exc}",
                target=target,
            ) from exc
        found = env_type(type(instance))
        close = getattr(instance, "close", None)
        if callable(close):
            close()
    if found is None:
        raise TargetError(
            f"{target!r}'s env factory does not build an OpenEnv Environment", target=target
        )
    return found


def package_version(cls: type[Any]) -> str | None:
    """The version of the installed distribution named after ``cls``'s top-level package
    (``coding_env``: ``coding_env``, ``coding-env``, ``openenv-coding_env`` or
    ``openenv-coding-env``, as OpenEnv names env packages), else ``None``. Looked up by
    name: scanning every installed distribution costs about a second."""
    top = cls.__module__.split(".")[0]
    for name in dict.fromkeys((top, top.replace("_", "-"))):
        for candidate in (name, f"openenv-{name}"):
            try:
                return importlib.metadata.version(candidate)
            except (importlib.metadata.PackageNotFoundError, ValueError):
                continue
    return None


def manifest_app(directory: Path, target: str) -> tuple[str, str]:
    """``(module or file path, attribute)`` of the app an env directory's
    ``openenv.yaml`` names (``app: server.app:app``; that default when absent).

    A module path that is a file in the directory (``server/app.py``) is returned as
    that file, so the directory's package layout decides how it is imported.

    Raises:
        TargetError: no ``openenv.yaml`` there, or it cannot be read.
    """
    manifest = directory / MANIFEST
    if not manifest.is_file():
        raise TargetError(
            f"{directory} is a directory without an {MANIFEST}: serve an env directory "
            "(OpenEnv's layout), a module:attribute or a file.py:Class",
            target=target,
        )
    try:
        import yaml

        data = yaml.safe_load(manifest.read_text(encoding="utf-8")) or {}
    except Exception as exc:
        raise TargetError(f"cannot read {manifest}: {exc}", target=target) from exc
    if not isinstance(data, dict):
        raise TargetError(f"{manifest} is not a mapping", target=target)
    spec = str(data.get("app") or DEFAULT_APP)
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise TargetError(f"{manifest}: app {spec!r} is not module:attribute", target=target)
    as_file = directory / (module.replace(".", "/") + ".py")
    return (str(as_file) if as_file.is_file() else module), attr


__all__ = [
    "OPENENV_API_VERSION",
    "OpenEnvApp",
    "app_settings",
    "env_class_of",
    "http_server_of",
    "is_openenv_app",
    "manifest_app",
    "package_version",
    "recording_servers",
]
