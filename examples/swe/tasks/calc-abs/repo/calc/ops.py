"""Small numeric helpers."""


def absolute(x):
    """The absolute value of ``x``."""
    return x


def clamp(x, low, high):
    """``x`` limited to the range [low, high]."""
    return max(low, min(x, high))
