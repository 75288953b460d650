"""The wheel's build hook (hatchling): the sandbox's native init goes into the wheel.

``native/stadium-init`` (Rust, no dependencies) is built with cargo into
``stadium/_server/isolation/stadium-init``, where the sandbox's template finds it (it runs a
sealed execute-only memfd copy of it, so the file's mode, 0755 as pip installs it, does not
matter). The wheel then carries a platform tag (``py3-none-linux_x86_64``, ...). Without
cargo, a binary ``make sandbox-deps`` built in the checkout is used; without either, the
wheel stays pure Python and says so (the sandbox then runs the same loop in a forked
interpreter, ~0.8 MiB more per session).
``STADIUM_NATIVE_INIT=require`` makes a missing init an error; ``=skip`` leaves it out.

The native ``--record`` writer (``native/stadium-record-writer``, arrow-rs' parquet from
crates.io) goes the same way into ``stadium/_server/ledger/stadium-record-writer``; without it
recording workers use the Python writer (and say so once). ``STADIUM_NATIVE_INIT`` governs it too.
So does the recording's step buffer (``native/stadium-record-buffer``, a CPython extension on
the stable ABI of Python >= 3.11, PyO3 from crates.io) into
``stadium/_server/ledger/_recordbuf.abi3.so``: with it the wheel is tagged ``cp311-abi3-...``;
without it recording workers copy steps in Python (and say so once).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

WHERE = "stadium/_server/isolation/stadium-init"
WRITER = "stadium/_server/ledger/stadium-record-writer"
BUFFER = "stadium/_server/ledger/_recordbuf.abi3.so"


class NativeInitHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return  # an editable install runs the checkout's own (make sandbox-deps)
        mode = os.environ.get("STADIUM_NATIVE_INIT", "auto")
        if mode == "skip" or not sys.platform.startswith("linux"):
            return
        built = _build(Path(self.root))
        if built is None:
            if mode == "require":
                raise RuntimeError("STADIUM_NATIVE_INIT=require: no cargo for native/stadium-init")
            self.app.display_warning(
                "stadium-init: no cargo and no built native/stadium-init: the wheel has no "
                "native init (sandboxed sessions' pid 1 stays a forked interpreter)"
            )
            return
        build_data["force_include"][str(built)] = WHERE
        try:  # (its crates come from crates.io: a build without them goes on without it)
            writer = _build(Path(self.root), "stadium-record-writer", WRITER, offline=False)
        except subprocess.CalledProcessError:
            writer = None
        if writer is not None:
            build_data["force_include"][str(writer)] = WRITER
        else:
            self.app.display_warning(
                "stadium-record-writer: no cargo and no built native writer: --record uses "
                "the Python writer"
            )
        try:
            buffer = _build(
                Path(self.root), "stadium-record-buffer", BUFFER, offline=False,
                product="lib_recordbuf.so",
            )  # fmt: skip
        except subprocess.CalledProcessError:
            buffer = None
        if buffer is not None:
            build_data["force_include"][str(buffer)] = BUFFER
        else:
            self.app.display_warning(
                "stadium-record-buffer: no cargo and no built native buffer: --record copies "
                "steps in Python"
            )
        # The binaries use no Python ABI; the buffer the stable one of Python >= 3.11.
        build_data["pure_python"] = False
        platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
        build_data["tag"] = f"{'cp311-abi3' if buffer else 'py3-none'}-{platform}"


def _build(
    root: Path,
    name: str = "stadium-init",
    where: str = WHERE,
    offline: bool = True,
    product: str = "",
) -> Path | None:
    manifest = root / "native" / name / "Cargo.toml"
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if manifest.is_file() and os.access(cargo, os.X_OK):
        # (PyO3 configures the buffer's build with this interpreter)
        env = {**os.environ, "PYO3_PYTHON": os.environ.get("PYO3_PYTHON", sys.executable)}
        subprocess.run(
            [cargo, "build", "--quiet", "--release", *(["--offline"] if offline else []),
             "--manifest-path", str(manifest)],
            check=True, env=env,
        )  # fmt: skip
        return manifest.parent / "target" / "release" / (product or name)
    checkout = root / "src" / where  # built by make sandbox-deps / record-deps
    return checkout if checkout.is_file() else None
