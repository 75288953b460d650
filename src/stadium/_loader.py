"""Resolve ``stadium serve TARGET`` to an environment class.

TARGET is a built-in name (``echo``), ``package.module:Class`` or ``path/to/file.py:Class``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from stadium._env import Environment
from stadium._errors import TargetError


def load_target(target: str) -> type[Environment[Any, Any, Any]]:
    """Import TARGET and return the environment class it names.

    Raises:
        TargetError: the module or attribute does not exist, or is not an Environment.
    """
    from stadium.envs import BUILTIN

    spec = BUILTIN.get(target, target)
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise TargetError(
            f"cannot understand target {target!r}: use a built-in name "
            f"({', '.join(sorted(BUILTIN))}), package.module:Class or path/to/file.py:Class",
            target=target,
        )
    module = _import(module_part, target)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TargetError(
                f"{module_part!r} has no attribute {attr!r} (target {target!r})", target=target
            ) from None
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise TargetError(
            f"{target!r} is {obj!r}, not a stadium.Environment subclass", target=target
        )
    return obj


def _import(module_part: str, target: str) -> Any:
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part).expanduser().resolve()
        if not path.is_file():
            raise TargetError(f"no such file: {path} (target {target!r})", target=target)
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
                f"importing {path} failed: {type(exc).__name__}: {exc}", target=target
            ) from exc
        return module
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as exc:
        raise TargetError(
            f"no module named {exc.name!r} while importing {module_part!r} (target {target!r}); "
            "is it installed, or on PYTHONPATH?",
            target=target,
        ) from exc
    except Exception as exc:
        raise TargetError(
            f"importing {module_part!r} failed: {type(exc).__name__}: {exc}", target=target
        ) from exc
