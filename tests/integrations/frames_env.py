"""A small deterministic Gymnasium env with image observations, for the integration tests.

Importing this module registers ``Frames-v0`` (so ``gymnasium.make(
"tests.integrations.frames_env:Frames-v0")`` works): a square moves on a
32x32 RGB frame toward a seeded target; actions are 2-D float velocities.
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

SIZE = 32


class FramesEnv(gymnasium.Env[np.ndarray, np.ndarray]):
    metadata = {"render_modes": []}

    def __init__(self, size: int = SIZE) -> None:
        self.size = size
        self.observation_space = spaces.Box(0, 255, (size, size, 3), np.uint8)
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self._pos = np.zeros(2)
        self._target = np.zeros(2)

    def _frame(self) -> np.ndarray:
        frame = np.zeros((self.size, self.size, 3), np.uint8)
        frame[:, :, 2] = np.arange(self.size, dtype=np.uint8)[None, :] * 4  # a gradient
        tx, ty = self._target.astype(int)
        frame[ty, tx] = (0, 255, 0)
        x, y = np.clip(self._pos, 0, self.size - 2).astype(int)
        frame[y : y + 2, x : x + 2] = (255, 0, 0)
        return frame

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._pos = self.np_random.uniform(0, self.size - 2, 2)
        self._target = self.np_random.integers(0, self.size, 2).astype(float)
        return self._frame(), {"target": self._target.copy()}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._pos = np.clip(self._pos + 3.0 * np.asarray(action, np.float64), 0, self.size - 1)
        distance = float(np.linalg.norm(self._pos - self._target))
        noise = float(self.np_random.normal(0, 0.01))
        return self._frame(), -distance + noise, distance < 2.0, False, {"distance": distance}


gymnasium.register("Frames-v0", entry_point=FramesEnv, max_episode_steps=20)
