"""Built-in environments, servable by short name (``stadium serve echo``)."""

from __future__ import annotations

from stadium.envs.benchmark import BenchmarkEnv
from stadium.envs.code import CodeEnv
from stadium.envs.echo import EchoEnv
from stadium.envs.shell import ShellEnv
from stadium.envs.tools import NotesEnv
from stadium.envs.wordguess import WordGuessEnv

BUILTIN: dict[str, str] = {
    "echo": "stadium.envs.echo:EchoEnv",
    "benchmark": "stadium.envs.benchmark:BenchmarkEnv",
    "wordguess": "stadium.envs.wordguess:WordGuessEnv",
    "tools": "stadium.envs.tools:NotesEnv",
    "code": "stadium.envs.code:CodeEnv",
    "shell": "stadium.envs.shell:ShellEnv",
    "swe": "stadium.envs.swe:SweEnv",
}

__all__ = [
    "BUILTIN",
    "BenchmarkEnv",
    "CodeEnv",
    "EchoEnv",
    "NotesEnv",
    "ShellEnv",
    "WordGuessEnv",
]
