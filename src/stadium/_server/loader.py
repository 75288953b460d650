"""Resolve ``stadium serve TARGET`` to an environment class.

TARGET is a built-in name (``echo``), ``package.module:Class``, ``path/to/file.py:Class``
or ``gymnasium:ENV_ID``. The class may be a Stadium ``Environment``, an OpenEnv
``Environment`` (wrapped by :mod:`stadium.integrations.openenv`) or a
``gymnasium.Env`` (wrapped by :mod:`stadium.integrations.gymnasium`).

TARGET may also be an OpenEnv *app*: ``pkg.server.app:app`` (what ``create_app(...)``
returned, as served with uvicorn), or an env directory with an ``openenv.yaml``
(whose ``app:`` names it). The env class, its action, observation and state models,
``max_concurrent_envs`` and the mode are read from what ``create_app`` was given
(:mod:`stadium.integrations.openenv_app`); OpenEnv's server is not started.

Where imports look (as uvicorn and ``python`` do, so projects serve as laid out):

* ``package.module:Class``: the working directory is put first on ``sys.path``.
* ``path/to/file.py:Class`` in a package (its directory has an ``__init__.py``):
  imported by its dotted name (``pkg.sub.file``), the directory above the
  outermost package first on ``sys.path``, so its relative imports work
  (``openenv init my_env``, then ``stadium serve
  my_env/server/my_env_environment.py:MyEnvironment``: ``from ..models import``).
  The outermost package is the last directory upward with an ``__init__.py`` and
  an identifier for a name: in a project directory named ``my-env``, ``server`` is
  the package and ``my-env`` goes on the path, so OpenEnv's fallback
  ``from models import ...`` works.
* any other ``file.py``: imported as a script runs, its directory first on ``sys.path``.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from stadium._env.contract import Environment
from stadium._errors import TargetError

GYMNASIUM_PREFIX = "gymnasium:"


def load_target(
    target: str,
    *,
    env_kwargs: dict[str, Any] | None = None,
    action_model: str | None = None,
) -> type[Environment[Any, Any, Any]]:
    """Import TARGET and return the environment class it names.

    Args:
        target: see the module docstring.
        env_kwargs: the server's ``--env-kwargs``. Only Gymnasium targets use them
            here (their spaces are read from an instance built with them); every
            target's instances are built with them by the server.
        action_model: ``--action-model module:Class`` (or ``file.py:Class``): the
            pydantic action model of an OpenEnv env class or app, over the one it
            declares (or the one ``create_app`` was given).

    Raises:
        TargetError: the module or attribute does not exist, is not an environment,
            or an optional dependency (gymnasium, openenv) is missing; an
            ``action_model`` for a target that is not an OpenEnv env.
    """
    from stadium.envs import BUILTIN

    if action_model is not None:
        served = load_target(target, env_kwargs=env_kwargs)
        from stadium.integrations.openenv import OpenEnvAdapter, openenv_environment

        if not issubclass(served, OpenEnvAdapter):
            raise TargetError(
                f"--action-model names the action model of an OpenEnv env; {target!r} is not "
                "one (a Stadium env declares its action type: Environment[Action, ...])",
                target=target,
            )
        model_module, model_attr = _split(action_model, action_model)
        model = _attribute(_import(model_module, action_model), model_attr, model_module)
        return openenv_environment(served.openenv_class, action=model, app=served.openenv_app)
    if target not in BUILTIN and os.path.isdir(target):
        from stadium.integrations.openenv_app import manifest_app

        module_part, attr = manifest_app(Path(target).resolve(), target)
        obj = _attribute(_import(module_part, target), attr, module_part)
        return _from_object(obj, target, env_kwargs)

    if target.startswith(GYMNASIUM_PREFIX):
        env_id = target[len(GYMNASIUM_PREFIX) :]
        if not env_id:
            raise TargetError(
                "gymnasium: needs an environment id, e.g. gymnasium:CartPole-v1", target=target
            )
        cls: type[Environment[Any, Any, Any]] = _gymnasium(target).gymnasium_environment(
            env_id, env_kwargs
        )
        return cls
    spec = BUILTIN.get(target, target)
    module_part, attr = _split(spec, target)
    obj = _attribute(_import(module_part, target), attr, module_part)
    return _from_object(obj, target, env_kwargs)


def _split(spec: str, target: str) -> tuple[str, str]:
    from stadium.envs import BUILTIN

    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise TargetError(
            f"cannot understand target {target!r}{_target_hint(target)}: use a built-in name "
            f"({', '.join(sorted(BUILTIN))}), package.module:Class, path/to/file.py:Class, "
            "pkg.server.app:app (an OpenEnv app) or an env directory with an openenv.yaml",
            target=target,
        )
    return module_part, attr


def _target_hint(target: str) -> str:
    """What ``target`` most likely meant: a file or module without its class, or a
    misspelt built-in name; empty when nothing is likely."""
    from stadium.envs import BUILTIN

    if target.endswith(".py") or "/" in target:
        return f" (a file target names its class: '{target.rstrip(':')}:ClassName')"
    close = difflib.get_close_matches(target, list(BUILTIN), n=1)
    return f" (did you mean the built-in {close[0]!r}?)" if close else ""


def _env_classes(module: Any) -> list[str]:
    """The environment classes ``module`` defines (not those it imports), by name."""
    name = getattr(module, "__name__", None)
    return sorted(
        key
        for key, value in vars(module).items()
        if isinstance(value, type)
        and issubclass(value, Environment)
        and getattr(value, "__module__", None) == name
    )


def _attribute(module: Any, attr: str, module_part: str) -> Any:
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            hint = ""
            if obj is module:
                classes = _env_classes(module)
                close = difflib.get_close_matches(part, classes or list(vars(module)), n=1)
                if close:
                    hint += f"; did you mean {close[0]!r}?"
                if classes:
                    hint += f" (its environment classes: {', '.join(classes)})"
            raise TargetError(
                f"{module_part!r} has no attribute {attr!r}{hint}",
                target=f"{module_part}:{attr}",
            ) from None
    return obj


def _from_object(
    obj: Any, target: str, env_kwargs: dict[str, Any] | None
) -> type[Environment[Any, Any, Any]]:
    """The environment class serving ``obj``: a Stadium, OpenEnv or Gymnasium env class,
    or an OpenEnv app."""
    if isinstance(obj, type) and issubclass(obj, Environment):
        return obj
    from stadium.integrations.openenv import is_openenv_environment

    if is_openenv_environment(obj):
        from stadium.integrations.openenv import openenv_environment

        return openenv_environment(obj)
    from stadium.integrations.openenv_app import is_openenv_app

    if is_openenv_app(obj):
        from stadium.integrations.openenv import openenv_environment
        from stadium.integrations.openenv_app import app_settings

        app = app_settings(obj, target)
        return openenv_environment(app.env_class, app=app)
    gym = sys.modules.get("gymnasium")
    if gym is not None and isinstance(obj, type) and issubclass(obj, gym.Env):
        gym_cls: type[Environment[Any, Any, Any]] = _gymnasium(target).gymnasium_environment(
            obj, env_kwargs
        )
        return gym_cls
    raise TargetError(
        f"{target!r} is {obj!r}, not a stadium.Environment subclass (nor an OpenEnv "
        "Environment or gymnasium.Env subclass, or an OpenEnv app from create_app(), "
        "which Stadium can also serve)",
        target=target,
    )


def _gymnasium(target: str) -> Any:
    """The Gymnasium integration module, or a TargetError saying what to install."""
    try:
        from stadium.integrations import gymnasium
    except ModuleNotFoundError as exc:
        raise TargetError(
            f"serving {target!r} needs {exc.name}: pip install 'stadium-rl[gym]'", target=target
        ) from exc
    return gymnasium


def _import(module_part: str, target: str) -> Any:
    """Import ``module_part`` (a module or a file), noting what OpenEnv apps created
    while it is imported are given (:func:`~stadium.integrations.openenv_app.recording_servers`)."""
    from stadium.integrations.openenv_app import recording_servers

    with recording_servers():
        return _import_module(module_part, target)


def _import_module(module_part: str, target: str) -> Any:
    if module_part.endswith(".py") or "/" in module_part:
        return _import_file(Path(module_part).expanduser().resolve(), target)
    add_to_path(os.getcwd())  # as uvicorn and ``python -m`` do
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as exc:
        raise TargetError(
            f"no module named {exc.name!r} while importing {module_part!r} (target {target!r}); "
            f"is it installed for {sys.executable} (the Python Stadium runs on), or on "
            "PYTHONPATH? (the working directory is searched too)",
            target=target,
        ) from exc
    except Exception as exc:
        raise TargetError(
            f"importing {module_part!r} failed: {type(exc).__name__}: {exc}", target=target
        ) from exc


def add_to_path(directory: str) -> None:
    """Put ``directory`` first on ``sys.path`` unless it is already there."""
    if directory not in sys.path and not (directory == os.getcwd() and "" in sys.path):
        sys.path.insert(0, directory)


def package_module(path: Path) -> tuple[Path, str] | None:
    """Where a file inside a package is imported from: ``(root, "pkg.sub.module")``.

    The package is every directory upward that holds an ``__init__.py`` and whose
    name is an identifier; ``root`` is the directory above the outermost one.
    ``None`` when the file's own directory is not a package.
    """
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file() and folder.name.isidentifier():
        parts.append(folder.name)
        folder = folder.parent
    if len(parts) == 1 or not path.stem.isidentifier():
        return None
    return folder, ".".join(reversed(parts))


def _import_file(path: Path, target: str) -> Any:
    """Import ``path`` so that its sibling imports work.

    A file in a package (see :func:`package_module`) is imported by its dotted
    name with the package's parent first on ``sys.path``, so relative imports
    work. Any other file is imported as a script runs: its directory first on the path.
    """
    if not path.is_file():
        raise TargetError(f"no such file: {path} (target {target!r})", target=target)
    found = package_module(path)
    if found is not None:
        root, dotted = found
        add_to_path(str(root))
        try:
            module = importlib.import_module(dotted)
        except Exception as exc:
            raise TargetError(
                f"importing {path} as {dotted} failed: {type(exc).__name__}: {exc}"
                f"{_missing_hint(exc)}",
                target=target,
            ) from exc
        where = getattr(module, "__file__", None)
        if where is None or Path(where).resolve() != path:
            raise TargetError(
                f"importing {path} as {dotted} found {where} instead: another {dotted!r} comes "
                "first on sys.path; serve it as a module target from its project directory",
                target=target,
            )
        return module
    add_to_path(str(path.parent))
    name = f"_stadium_target_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    mod_spec = importlib.util.spec_from_file_location(name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise TargetError(f"cannot import {path} (target {target!r})", target=target)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module
    try:
        mod_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise TargetError(
            f"importing {path} failed: {type(exc).__name__}: {exc}{_missing_hint(exc)}",
            target=target,
        ) from exc
    return module


def _missing_hint(exc: BaseException) -> str:
    """For a module the target's code imports and this Python lacks: where to install it
    (the classic: installed into another Python than the one Stadium runs on)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return ""
    return (
        f"; install {exc.name.split('.')[0]!r} into the Python Stadium runs on "
        f"({sys.executable} -m pip install ...)"
    )


def target_files(target: str) -> tuple[list[str], str | None]:
    """Without importing anything of it: the folders :func:`load_target` would put first on
    ``sys.path`` for ``target``, and the file of its module when that can be found by
    looking (``--untrusted-env-code``: the sandbox needs the folders bound, the manifest
    search the file; only ``openenv.yaml`` is read, as data).

    A dotted module is looked for on ``sys.path`` (the working directory first) as a
    ``.py`` file or a package's ``__init__.py``, as the import system would find a plain
    source module; not found (a namespace package, an extension, an import hook): no file.
    """
    from stadium.envs import BUILTIN

    spec = BUILTIN.get(target, target)
    if target.startswith(GYMNASIUM_PREFIX):
        return [], None
    if target not in BUILTIN and os.path.isdir(target):
        from stadium.integrations.openenv_app import manifest_app

        module_part, _attr = manifest_app(Path(target).resolve(), target)
    else:
        module_part, _attr = _split(spec, target)
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part).expanduser().resolve()
        found = package_module(path)
        return [str(found[0] if found is not None else path.parent)], str(path)
    folders = [] if target in BUILTIN else [os.getcwd()]
    parts = module_part.split(".")
    if not all(p.isidentifier() for p in parts):
        return folders, None
    for base in [os.getcwd(), *sys.path]:
        root = Path(base or os.getcwd())
        module_file = root.joinpath(*parts[:-1], parts[-1] + ".py")
        for candidate in (module_file, root.joinpath(*parts, "__init__.py")):
            if candidate.is_file():
                return folders, str(candidate)
    return folders, None
