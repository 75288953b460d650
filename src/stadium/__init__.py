"""Stadium: serve RL and LLM-agent environments to thousands of concurrent sessions."""

from __future__ import annotations

__version__ = "0.1.0"
