"""``tools``: a tool environment (MCP): a per-session notebook and a calculator.

Tools: ``add_note(text)``, ``list_notes()``, ``clear_notes()`` keep notes in the
session's own instance (two sessions never see each other's notes);
``calculate(a, op, b)`` does arithmetic; ``submit(answer)`` ends the episode,
reward 1.0 when the answer is the sum of the numbers in the notes. Call them
over ``POST /mcp``, the ``"mcp"`` WebSocket message, or as ``step`` actions
``{"type": "call_tool", "tool_name": "add_note", "arguments": {"text": "hi"}}``.
"""

from __future__ import annotations

from typing import Any, Literal

from stadium._env.contract import StepResult
from stadium._env.tool_env import ToolEnvironment, ToolObservation, tool


class NotesEnv(ToolEnvironment):
    """Notes kept per session, and a calculator: a tool environment served over MCP."""

    name = "tools"
    version = "1.0"

    def __init__(self) -> None:
        self.notes: list[str] = []

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> ToolObservation:
        self.notes.clear()
        return self.tools_observation()

    @tool
    def add_note(self, text: str) -> int:
        """Add a note to this session's notebook; returns how many notes it holds."""
        self.notes.append(text)
        return len(self.notes)

    @tool
    def list_notes(self) -> list[str]:
        """The notes of this session, oldest first."""
        return list(self.notes)

    @tool
    def clear_notes(self) -> int:
        """Remove every note; returns how many were removed."""
        count = len(self.notes)
        self.notes.clear()
        return count

    @tool
    def calculate(self, a: float, op: Literal["+", "-", "*", "/"], b: float) -> float:
        """``a op b`` for op in + - * /."""
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if b == 0:
            raise ZeroDivisionError("division by zero")
        return a / b

    @tool
    def submit(self, answer: float) -> StepResult[float]:
        """End the episode: reward 1.0 if ``answer`` is the sum of the numeric notes."""
        total = 0.0
        for note in self.notes:
            try:
                total += float(note)
            except ValueError:
                continue
        return StepResult(answer, reward=1.0 if abs(answer - total) < 1e-9 else 0.0, done=True)
