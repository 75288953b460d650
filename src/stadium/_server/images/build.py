"""``--image build``: an env directory's container recipe, built with Podman into the image
its sessions run in (issue #31 item 5; docs/IMAGES.md "Env directories with a recipe").

OpenEnv ships an env as a directory with its recipe at ``server/Dockerfile`` (or
``Dockerfile`` at its root; ``Containerfile`` is taken too), built with the directory as the
context. :func:`build_image` builds it with ``podman build --pull=never`` and returns the
Podman REF the node's store prepares like any other (``localhost/stadium-build-NAME:KEY``).

* **Cache.** ``KEY`` is a digest of the directory's content (every file's path, mode and
  bytes but ``.git``, ``__pycache__`` and ``*.pyc``), the recipe's path and the base: an
  image already tagged with it is used as is (no build); a changed directory builds again
  and Podman's layer cache reuses every step before the first one whose input changed.
* **Bases.** No registry may be reachable, so nothing is pulled: every image the recipe
  builds ``FROM`` (after its global ``ARG`` defaults, ``FROM ${BASE_IMAGE}``) must be in the
  node's Podman storage. ``--image build:BASE`` substitutes ``BASE`` for every one of them
  (not for the recipe's own stages, nor ``scratch``): the recipe is rewritten to a
  temporary file, the directory stays the context. A missing base is a
  :class:`~stadium.ConfigError` naming it and this option.
* **Errors** (each a ``ConfigError`` saying what to do): no recipe, Podman missing, a
  failing build (the last lines of its output in the message).

What runs inside: the session's ``/`` is the built image (its files, its ``PATH``, its
``WorkingDir``; commands and :class:`stadium.Workspace` use them); the env's own process
is the worker's warm template's fork, on the server's interpreter, with the env's code
imported on the host (docs/IMAGES.md says why the image's own interpreter is not used).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile

from stadium._errors import ConfigError

__all__ = ["BUILD", "build_image", "build_spec", "find_recipe", "recipe_bases"]

#: The ``--image`` value that builds the env directory's recipe (``build:BASE``: with a base).
BUILD = "build"
#: Where a recipe may be, relative to the env directory, in the order looked for.
RECIPES = ("server/Dockerfile", "Dockerfile", "server/Containerfile", "Containerfile")
#: The label a built image carries: its content key.
LABEL = "ai.stadium.build.key"
BUILD_TIMEOUT_S = 1800.0
QUERY_TIMEOUT_S = 120.0
#: Bounds on the directory digested (an env directory, not a dataset).
MAX_FILES = 50_000
MAX_BYTES = 2 << 30
#: Characters of a failing build's output the error keeps (from the end).
TAIL_CHARS = 3000
_SKIP_DIRS = frozenset({".git", "__pycache__", ".venv", ".mypy_cache", ".pytest_cache"})
_ARG = re.compile(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?\s*$", re.IGNORECASE)
_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE)
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def build_spec(image: str | None) -> tuple[bool, str | None]:
    """Whether ``--image`` asks for a build, and the base it substitutes (``build:BASE``)."""
    if image is None or not (image == BUILD or image.startswith(BUILD + ":")):
        return False, None
    base = image[len(BUILD) + 1 :].strip() or None
    return True, base


def find_recipe(env_dir: str) -> str:
    """The env directory's recipe (absolute path).

    Raises:
        ConfigError: not a directory, or no recipe where OpenEnv puts one.
    """
    if not os.path.isdir(env_dir):
        raise ConfigError(
            f"--image build builds an env directory's recipe, but the target {env_dir!r} is "
            "not a directory: serve the env directory (stadium serve ENV_DIR --image build), "
            "or name a built image with --image REF",
            target=env_dir,
        )
    for rel in RECIPES:
        path = os.path.join(env_dir, rel)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise ConfigError(
        f"--image build: {env_dir} has no container recipe (looked for "
        f"{', '.join(RECIPES)}); add one (OpenEnv's layout: server/Dockerfile), or name an "
        "image with --image REF",
        target=env_dir,
    )


def _expand(word: str, args: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        value = args.get(name, "")
        return value or (m.group(2) or "") if m.group(1) else value

    return _VAR.sub(one, word)


def _lines(text: str) -> list[str]:
    """The recipe's instructions, continuation lines joined, comments dropped."""
    out: list[str] = []
    pending = ""
    for raw in text.splitlines():
        if not pending and raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        out.append(pending + raw)
        pending = ""
    if pending:
        out.append(pending)
    return out


def recipe_bases(text: str) -> list[str]:
    """The images a recipe builds ``FROM`` (global ``ARG`` defaults expanded; its own
    stages and ``scratch`` left out), in order, each once."""
    args: dict[str, str] = {}
    stages: set[str] = set()
    bases: list[str] = []
    seen_from = False
    for line in _lines(text):
        arg = _ARG.match(line)
        if arg and not seen_from:
            args[arg.group(1)] = arg.group(2) or ""
            continue
        found = _FROM.match(line)
        if not found:
            continue
        seen_from = True
        ref = _expand(found.group(3), args)
        rest = found.group(4).split()
        if ref.lower() != "scratch" and ref not in stages and ref not in bases:
            bases.append(ref)
        if len(rest) >= 2 and rest[0].lower() == "as":
            stages.add(rest[1])
    return bases


def _rebase(text: str, base: str) -> str:
    """The recipe with every external ``FROM`` image replaced by ``base`` (only ``FROM``
    lines change; a ``FROM`` continued over lines is not supported)."""
    stages: set[str] = set()
    out: list[str] = []
    for line in text.splitlines():
        found = _FROM.match(line)
        if found:
            rest = found.group(4).split()
            token = found.group(3)
            if token.lower() != "scratch" and token not in stages:
                line = f"{found.group(1)}{found.group(2)}{base}{found.group(4)}"
            if len(rest) >= 2 and rest[0].lower() == "as":
                stages.add(rest[1])
        out.append(line)
    return "\n".join(out) + "\n"


def content_key(env_dir: str, recipe: str, base: str | None) -> str:
    """A digest of the directory's content, the recipe's path and the base (hex, 64)."""
    digest = hashlib.sha256(f"{os.path.relpath(recipe, env_dir)}\0{base or ''}\0".encode())
    files = total = 0
    for folder, dirs, names in os.walk(env_dir):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        links = [d for d in dirs if os.path.islink(os.path.join(folder, d))]  # not walked
        for name in sorted(names + links):
            if name.endswith(".pyc"):
                continue
            path = os.path.join(folder, name)
            info = os.lstat(path)
            files += 1
            total += info.st_size
            if files > MAX_FILES or total > MAX_BYTES:
                raise ConfigError(
                    f"--image build: {env_dir} holds more than {MAX_FILES} files or "
                    f"{MAX_BYTES >> 20} MiB; build its image yourself (podman build) and "
                    "serve it with --image localhost/NAME:TAG",
                    target=env_dir,
                )
            rel = os.path.relpath(path, env_dir).encode()
            digest.update(rel + b"\0" + oct(info.st_mode).encode() + b"\0")
            if stat.S_ISLNK(info.st_mode):
                digest.update(os.fsencode(os.readlink(path)))
            elif stat.S_ISREG(info.st_mode):
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 20):
                        digest.update(chunk)
            digest.update(b"\0")
    return digest.hexdigest()


def _podman() -> str:
    exe = shutil.which("podman")
    if exe is None:
        raise ConfigError(
            "--image build builds the env's recipe with Podman, which is not installed "
            "(`make container-deps` or scripts/install-container-deps.sh installs it); or "
            "build the image elsewhere and serve it with --image REF (oci-archive:FILE, "
            "dir:/rootfs)"
        )
    return exe


def _exists(exe: str, ref: str) -> bool:
    try:
        done = subprocess.run(
            [exe, "image", "exists", "--", ref], capture_output=True, timeout=QUERY_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"--image build: podman image exists {ref} took too long") from None
    return done.returncode == 0


def _tag(env_dir: str, key: str) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", os.path.basename(os.path.abspath(env_dir)).lower())
    return f"localhost/stadium-build-{name.strip('.-_') or 'env'}:{key[:16]}"


def build_image(env_dir: str, base: str | None = None) -> str:
    """Build ``env_dir``'s recipe (unless an image of its content is there already) and
    return its Podman REF (blocking: minutes the first time; see the module docstring).

    Raises:
        ConfigError: no recipe, Podman missing, a base not in the node's storage, a
            failing build (with the tail of its output).
    """
    recipe = find_recipe(env_dir)
    exe = _podman()
    tag = _tag(env_dir, content_key(env_dir, recipe, base))
    if _exists(exe, tag):
        return tag
    with open(recipe, encoding="utf-8", errors="replace") as f:
        text = f.read(1 << 20)
    bases = [base] if base else recipe_bases(text)
    for ref in bases:
        if not _exists(exe, ref):
            hint = (
                f"--image build:{ref}: no such image in this node's Podman storage (build or "
                "import it first; `podman images` lists them)"
                if base
                else f"{recipe} builds FROM {ref}, which is not in this node's Podman storage, "
                f"and Stadium builds without pulling (no registry may be reachable): pull it "
                f"(podman pull {ref}) or substitute a local image for every FROM with "
                "--image build:BASE (e.g. build:localhost/stadium-test-base:trixie)"
            )
            raise ConfigError(hint, image=ref)
    with tempfile.TemporaryDirectory(prefix="stadium-build-") as tmp:
        if base:
            used = os.path.join(tmp, "Containerfile")
            with open(used, "w", encoding="utf-8") as f:
                f.write(_rebase(text, base))
        else:
            used = recipe
        cmd = [exe, "build", "--pull=never", "--format", "oci", "--layers",
               "--label", f"{LABEL}={tag.rpartition(':')[2]}", "-t", tag, "-f", used,
               os.path.abspath(env_dir)]  # fmt: skip
        try:
            done = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=BUILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise ConfigError(
                f"--image build: building {recipe} took over {BUILD_TIMEOUT_S:g} s", image=tag
            ) from None
    if done.returncode != 0:
        output = (done.stdout + done.stderr).decode("utf-8", "replace").strip()
        raise ConfigError(
            f"--image build: podman build of {recipe} failed (exit {done.returncode}); fix the "
            f"recipe (or its base: --image build:BASE). Its last lines:\n{output[-TAIL_CHARS:]}",
            image=tag,
        )
    return tag
