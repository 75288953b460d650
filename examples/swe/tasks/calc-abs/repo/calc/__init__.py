"""A tiny arithmetic package (a SWE task for Stadium's ``swe`` env)."""

from calc.ops import absolute, clamp

__all__ = ["absolute", "clamp"]
