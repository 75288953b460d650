"""``stadium init NAME``: create a ready-to-run environment package from the templates.

The project it writes (``NAME/``) has a ``pyproject.toml`` depending on
``stadium-rl`` (Stadium's distribution name; it installs the ``stadium`` package),
the environment in ``src/<module>/env.py`` (typed action and observation, a
seeded ``reset``), ``tests/test_env.py`` calling :func:`stadium.check_env`, a
README and a Dockerfile that runs ``stadium serve <module>.env:Env``. It passes
its own tests as generated (``pytest`` in the new directory; ``src`` is on the
test path, so no install is needed first).

Templates live in ``stadium/templates/env`` as ``*.tmpl`` files with
:class:`string.Template` placeholders (``${module}``, ``${title}``, ...); a
``__module__`` path segment becomes the module name, and ``dockerignore``
becomes ``.dockerignore``.
"""

from __future__ import annotations

import keyword
import re
import string
import sys
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

from stadium._errors import ConfigError
from stadium._version import __version__

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
_TEMPLATE = "env"


def module_name(name: str) -> str:
    """The Python package name for project ``name`` (``my-env`` → ``my_env``).

    Raises:
        ConfigError: the name cannot be a Python package, or would shadow one
            (the standard library, ``stadium``).
    """
    if not _NAME.match(name):
        raise ConfigError(
            f"project name {name!r} must start with a letter and contain only letters, "
            "digits, '_' and '-', e.g. my_env",
            name=name,
        )
    module = name.replace("-", "_").lower()
    if keyword.iskeyword(module):
        raise ConfigError(f"{name!r} is a Python keyword; choose another name", name=name)
    if module in sys.stdlib_module_names or module in ("stadium", "tests", "test"):
        raise ConfigError(
            f"{name!r} would shadow the module {module!r}; choose another name, e.g. {module}_env",
            name=name,
        )
    return module


def _files(root: Traversable, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    out: list[tuple[tuple[str, ...], str]] = []
    for item in sorted(root.iterdir(), key=lambda t: t.name):
        if item.is_dir():
            if item.name != "__pycache__":
                out.extend(_files(item, (*prefix, item.name)))
        elif item.name.endswith(".tmpl"):
            out.append(((*prefix, item.name.removesuffix(".tmpl")), item.read_text("utf-8")))
    return out


def create_project(name: str, parent: Path | str = ".") -> Path:
    """Write the project ``name`` into ``parent/name``; return its path.

    Raises:
        ConfigError: bad name, or ``parent/name`` already exists (nothing is overwritten).
    """
    module = module_name(name)
    target = Path(parent) / name
    if target.exists():
        raise ConfigError(
            f"{target} already exists; stadium init never overwrites: remove it or pick "
            "another name",
            path=str(target),
        )
    values = {
        "name": name,
        "project": name.lower().replace("_", "-"),
        "module": module,
        "title": " ".join(part.capitalize() for part in re.split(r"[_-]+", name) if part),
        "stadium_version": ".".join(__version__.split(".")[:2]),
    }
    templates = resources.files("stadium") / "templates" / _TEMPLATE
    rendered: list[tuple[Path, str]] = []
    for parts, text in _files(templates):
        rel = [module if p == "__module__" else p for p in parts]
        if rel[-1] == "dockerignore":
            rel[-1] = ".dockerignore"
        try:
            content = string.Template(text).substitute(values)
        except (KeyError, ValueError) as exc:  # a broken template is our bug, not the user's
            raise RuntimeError(f"template {'/'.join(parts)} is broken: {exc}") from exc
        rendered.append((target.joinpath(*rel), content))
    try:
        target.mkdir(parents=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {target}: {exc.strerror}", path=str(target)) from None
    for path, content in rendered:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, "utf-8")
    return target


__all__ = ["create_project", "module_name"]
