"""The example SWE tasks (``examples/swe``) as the tests use them: inline (no image) or as
built task images."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "swe"
TASKS_FILE = EXAMPLES / "tasks.jsonl"


def image_tasks() -> list[dict[str, Any]]:
    """The example tasks as the JSONL file gives them (each in its image)."""
    return [json.loads(line) for line in TASKS_FILE.read_text().splitlines() if line.strip()]


def inline_tasks() -> list[dict[str, Any]]:
    """The same tasks without images: each repository's files inline."""
    tasks = []
    for task in image_tasks():
        repo = EXAMPLES / "tasks" / task["instance_id"] / "repo"
        files = {}
        for folder, _, names in os.walk(repo):
            for name in names:
                path = Path(folder) / name
                files[str(path.relative_to(repo))] = path.read_text()
        tasks.append({**task, "image": None, "repo": "", "files": files})
    return tasks


#: The right fix of each example task (a path and its new text).
FIXES = {
    "calc-abs": (
        "calc/ops.py",
        '"""Small numeric helpers."""\n\n\ndef absolute(x):\n    return -x if x < 0 else x\n\n\n'
        "def clamp(x, low, high):\n    return max(low, min(x, high))\n",
    ),
    "slug-case": (
        "textkit/slug.py",
        "import re\n\n\ndef slugify(title):\n"
        "    return '-'.join(w.lower() for w in re.split(r'[^A-Za-z0-9]+', title) if w)\n",
    ),
}
