"""``wordguess``: a small multi-turn text game with a real reward.

The environment picks a secret five-letter word (seeded). Each turn the agent
guesses a word and gets Wordle-style feedback: ``G`` right letter in the right
place, ``Y`` in the word elsewhere, ``.`` absent. Reward per turn is the share
of greens; a solved game pays ``1 + remaining_turns / max_turns``; the episode
ends when solved or after ``max_turns`` guesses (truncated).
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

from stadium._env.contract import Environment, State, StepResult

WORDS: tuple[str, ...] = (
    "apple", "brave", "chair", "dance", "eagle", "flame", "grape", "house",
    "input", "joker", "knife", "lemon", "mango", "noble", "ocean", "piano",
    "queen", "river", "stone", "tiger", "urban", "vivid", "whale", "xenon",
    "yacht", "zebra", "crane", "plant", "storm", "light",
)  # fmt: skip


class Guess(msgspec.Struct):
    """A five-letter guess."""

    word: str


class Feedback(msgspec.Struct):
    """What the agent sees after each turn."""

    prompt: str
    feedback: str = ""
    guesses: list[str] = msgspec.field(default_factory=list)
    turns_left: int = 6
    solved: bool = False


class WordGuessState(State, kw_only=True):
    """Episode counters and the turns left (the secret is not exposed)."""

    turns_left: int = 6
    solved: bool = False


def score(secret: str, guess: str) -> str:
    """Wordle feedback: ``G`` green, ``Y`` yellow, ``.`` grey (duplicates handled)."""
    marks = ["."] * len(secret)
    pool: dict[str, int] = {}
    for i, (s, g) in enumerate(zip(secret, guess, strict=True)):
        if s == g:
            marks[i] = "G"
        else:
            pool[s] = pool.get(s, 0) + 1
    for i, g in enumerate(guess):
        if marks[i] != "G" and pool.get(g, 0) > 0:
            marks[i] = "Y"
            pool[g] -= 1
    return "".join(marks)


class WordGuessEnv(Environment[Guess, Feedback, WordGuessState]):
    """Guess the secret five-letter word in at most six turns."""

    name = "wordguess"
    version = "1.0"
    blocking = False
    max_turns = 6

    def __init__(self) -> None:
        self._secret = ""
        self._guesses: list[str] = []
        self._solved = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Feedback:
        rng = random.Random(seed)
        self._secret = rng.choice(WORDS)
        self._guesses = []
        self._solved = False
        return Feedback(
            prompt=f"Guess the secret five-letter word. You have {self.max_turns} turns.",
            turns_left=self.max_turns,
        )

    def step(self, action: Guess) -> StepResult[Feedback]:
        word = action.word.strip().lower()
        if len(word) != 5 or not word.isalpha():
            raise ValueError(f"a guess must be five letters a-z, got {action.word!r}")
        if self._solved or len(self._guesses) >= self.max_turns:
            raise ValueError("the game is over: reset to play again")
        self._guesses.append(word)
        marks = score(self._secret, word)
        left = self.max_turns - len(self._guesses)
        self._solved = word == self._secret
        reward = marks.count("G") / 5
        if self._solved:
            reward = 1.0 + left / self.max_turns
        obs = Feedback(
            prompt="Solved!" if self._solved else f"{marks} — {left} turns left.",
            feedback=marks,
            guesses=list(self._guesses),
            turns_left=left,
            solved=self._solved,
        )
        return StepResult(obs, reward, self._solved, truncated=not self._solved and left == 0)

    def sample_action(self, rng: random.Random) -> Guess:
        """A random word from the list (used by ``check_env``)."""
        return Guess(word=rng.choice(WORDS))

    @property
    def state(self) -> WordGuessState:
        return WordGuessState(
            step_count=len(self._guesses),
            turns_left=self.max_turns - len(self._guesses),
            solved=self._solved,
        )
