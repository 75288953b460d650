"""An env that grades code it cannot trust, the way the built-in ``code`` env does.

The policy's submission runs in a process of its own; the grader (the env) keeps the
expected values, sends each test's arguments, reads back plain values decoded into the
declared type, and compares them itself: nothing the submission prints, exits with or
overrides counts (docs/GRADING.md). Run it: ``python examples/graded_env.py``; serve it
as it asks (a sandbox per session; root, bubblewrap and cgroups):
``stadium serve examples/graded_env.py:SortWords``.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from typing import Any, ClassVar

import msgspec

import stadium
from stadium.envs.code import run_tests

TESTS: list[tuple[list[Any], Any]] = [
    ([["pear", "fig", "apple"]], ["apple", "fig", "pear"]),
    ([[]], []),
    ([["b", "a", "b"]], ["a", "b", "b"]),
]


class Submission(msgspec.Struct):
    code: str  # defines sort_words(words) -> list[str]


class Graded(msgspec.Struct):
    passed: int
    total: int
    failures: list[str]


class SortWords(stadium.Environment[Submission, Graded, stadium.State]):
    """Write sort_words(words); reward = the share of tests passed."""

    isolation: ClassVar[str] = "sandbox"  # the submission runs as the session's own uid

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Graded:
        self.folder = tempfile.mkdtemp(prefix="sort-words-")
        return Graded(0, len(TESTS), [])

    def step(self, action: Submission) -> stadium.StepResult[Graded]:
        with open(os.path.join(self.folder, "submission.py"), "w") as f:
            f.write(action.code)
        # returns=list[str]: a reply decodes into that type or fails its test; the
        # comparison happens here, on plain values.
        report = run_tests(self.folder, "sort_words", TESTS, list[str], timeout_s=5.0)
        graded = Graded(report.passed, len(TESTS), report.failures)
        return stadium.StepResult(graded, reward=report.passed / len(TESTS), done=True)

    def close(self) -> None:
        shutil.rmtree(getattr(self, "folder", ""), ignore_errors=True)

    def sample_action(self, rng: random.Random) -> Submission:
        return Submission("def sort_words(words):\n    return sorted(words)\n")


def main() -> None:
    forged = (  # the classic forgery: print a results line, exit before any test runs
        "import os\nprint('{\"results\": [[true, null], [true, null], [true, null]]}')\n"
        "os._exit(0)\n"
    )
    env = SortWords()
    for code in ("def sort_words(words):\n    return sorted(words)\n", forged):
        env.reset()
        result = env.step(Submission(code))
        print(f"reward {result.reward}: {result.observation.failures}")
        env.close()


if __name__ == "__main__":
    main()
