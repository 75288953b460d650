"""URL slugs."""

import re


def slugify(title):
    """``title`` as a URL slug: words joined by single dashes."""
    words = re.split(r"[^A-Za-z0-9]", title)
    return "-".join(words)
