"""The documents' links: every relative Markdown link in README.md, CHANGELOG.md,
BENCHMARKS.md and docs/**/*.md names a file that exists, and every ``#anchor`` (in the same
file or another Markdown file) names one of its headings, slugged as GitHub slugs them
(lowercase; punctuation dropped; each space a ``-``; a repeated heading gets ``-1``,
``-2``, ...). Links in code (fenced blocks, inline code) are not links and are skipped.

And the client examples of README.md and docs/ run as written, against a server of the
README's own env (or of a Gymnasium env for ``stadium.gym``'s); every ``stadium.X`` they
name exists; every ``stadium CMD --flag`` they show is an option of CMD.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import click
import pytest

from stadium._cli.main import cli
from tests.conftest import UNIT, serve

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def documents(root: Path = ROOT) -> list[Path]:
    """The documents whose links are checked."""
    named = [root / name for name in ("README.md", "CHANGELOG.md", "BENCHMARKS.md")]
    return [p for p in named if p.exists()] + sorted((root / "docs").rglob("*.md"))


def slug(heading: str) -> str:
    """``heading``'s anchor as GitHub makes it (before duplicates are numbered)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # HTML tags
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)  # punctuation and symbols dropped
    return text.replace(" ", "-")


def _prose(text: str) -> list[str]:
    """``text``'s lines with fenced code blocked out (as empty lines: numbering kept)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return out


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown text defines: its headings' slugs (duplicates numbered as
    GitHub numbers them) and explicit ``<a name=...>`` / ``<a id=...>``."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(text):
        out.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of every Markdown link outside code (a link's text may
    run over lines)."""
    prose = "\n".join(_prose(text))
    prose = _INLINE_CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in _LINK.finditer(prose)]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with ``path``'s relative links: one line per broken link, saying which
    and why (a missing file, a missing anchor); empty when every link holds."""
    text = path.read_text(encoding="utf-8")
    own = anchors(text)
    cache: dict[Path, set[str]] = {}
    problems = []
    for number, target in links(text):
        if not target or _SCHEME.match(target):  # http:, https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.relative_to(root)}:{number}: {target}"
        if file_part:
            dest = (path.parent / file_part).resolve()
            if not dest.exists():
                problems.append(f"{where}: no such file {file_part}")
                continue
            if not anchor or dest.suffix != ".md" or dest.is_dir():
                continue
            if dest not in cache:
                cache[dest] = anchors(dest.read_text(encoding="utf-8"))
            names = cache[dest]
        else:
            names = own
        if anchor and anchor not in names:
            problems.append(f"{where}: no heading with the anchor #{anchor}")
    return problems


def test_every_link_of_the_documents_holds() -> None:
    docs = documents()
    assert len(docs) >= 10, docs
    problems = [problem for path in docs for problem in broken_links(path)]
    assert problems == [], "broken links:\n" + "\n".join(problems)


def test_slugs_follow_githubs_rules() -> None:
    assert slug("Isolated sessions") == "isolated-sessions"
    assert slug("The seam: what the worker takes from a sandbox") == (
        "the-seam-what-the-worker-takes-from-a-sandbox"
    )
    assert slug("`_core/`: the pure protocol core") == "_core-the-pure-protocol-core"
    assert slug("Isolated sessions: in-process / process / sandbox") == (
        "isolated-sessions-in-process--process--sandbox"
    )
    assert slug("Batched steps through `SessionPool` (issue 25, item 4)") == (
        "batched-steps-through-sessionpool-issue-25-item-4"
    )
    assert slug("The study's run, reproduced") == "the-studys-run-reproduced"
    assert slug("See [the docs](docs/X.md) here") == "see-the-docs-here"
    text = "# Top\n\n## Part\n\n```\n# not a heading\n```\n\n## Part\n"
    assert anchors(text) == {"top", "part", "part-1"}


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "OTHER.md").write_text("# Other\n\n## A part\n")
    doc = tmp_path / "README.md"
    doc.write_text(
        "# Title\n\n## Here\n\n"
        "[ok](docs/OTHER.md) [ok](docs/OTHER.md#a-part) [ok](#here) [ok](docs/)\n"
        "[web](https://example.com/x#y) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n"
        "[gone](docs/MISSING.md)\n"
        "[bad](docs/OTHER.md#no-such-part)\n"
        "[bad here](#nowhere)\n"
    )
    problems = broken_links(doc, tmp_path)
    assert [p.split(": ", 1)[0] for p in problems] == [
        "README.md:10",
        "README.md:11",
        "README.md:12",
    ]
    assert "no such file docs/MISSING.md" in problems[0]
    assert "#no-such-part" in problems[1]
    assert "#nowhere" in problems[2]


def test_a_broken_link_injected_into_a_copy_of_the_readme_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    for path in (ROOT / "docs").glob("*.md"):
        (tmp_path / "docs" / path.name).write_text(path.read_text(encoding="utf-8"))
    for name in ("README.md", "BENCHMARKS.md", "CHANGELOG.md"):
        (tmp_path / name).write_text((ROOT / name).read_text(encoding="utf-8"))
    readme = tmp_path / "README.md"
    assert broken_links(readme, tmp_path) == []
    text = readme.read_text(encoding="utf-8")
    readme.write_text(
        text.replace("(docs/SECURITY.md)", "(docs/SECURITY.md#no-such-heading)", 1)
        + "\nSee [gone](docs/GONE.md).\n"
    )
    problems = broken_links(readme, tmp_path)
    assert len(problems) == 2, problems
    assert any("#no-such-heading" in p for p in problems)
    assert any("no such file docs/GONE.md" in p for p in problems)


# -- the documents' client examples run as written ------------------------------------


def python_blocks(path: Path) -> list[str]:
    """Every fenced ```python block of ``path``, in order."""
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def run_block(block: str, url: str) -> int:
    """Run a document's code block as a user would paste it into a script, against ``url``
    (its ``http://127.0.0.1:8000`` replaced), then every ``async def`` it defines with
    ``asyncio.run``; return how many those were. Called in a thread: the sync client must
    not block the server's loop."""
    code = compile(block.replace("http://127.0.0.1:8000", url), "<doc block>", "exec")
    namespace: dict[str, Any] = {"__name__": "doc_block"}
    exec(code, namespace)  # a SyntaxError here: the block is not valid Python as shown
    ran = 0
    for value in list(namespace.values()):
        if inspect.iscoroutinefunction(value) and value.__code__.co_filename == "<doc block>":
            asyncio.run(value())
            ran += 1
    return ran


def _readme_game(tmp_path: Path) -> str:
    """The README's example env (``Game``), as a target."""
    (block,) = [b for b in python_blocks(ROOT / "README.md") if "class Game(" in b]
    path = tmp_path / "game.py"
    path.write_text(block)
    return f"{path}:Game"


async def test_the_readme_and_clients_drive_examples_run_against_the_readme_env(
    tmp_path: Path,
) -> None:
    """The "Drive it" block of README.md and docs/CLIENTS.md (the sync client, then a
    `SessionPool` of 256), and CLIENTS.md's EnvPool-style `send`/`recv`, against `stadium
    serve game.py:Game`: the first once had an `async with` at the top level (a SyntaxError
    pasted into a script); CLIENTS.md's prose read as `recv(batch_size=K)`, a TypeError."""
    drives = [
        b
        for path in (ROOT / "README.md", ROOT / "docs" / "CLIENTS.md")
        for b in python_blocks(path)
        if "stadium.SessionPool(" in b
    ]
    assert len(drives) == 3, drives  # README's, CLIENTS.md's copy, CLIENTS.md's send/recv
    async with serve(_readme_game(tmp_path)) as server:
        for block in drives:
            ran = await asyncio.wait_for(asyncio.to_thread(run_block, block, server.url), 30 * UNIT)
            assert ran == 1, "the SessionPool example is one async function, run"


async def test_the_clients_gymnasium_example_runs_against_a_gymnasium_env() -> None:
    """docs/CLIENTS.md's `stadium.gym` block against `stadium serve gymnasium:CartPole-v1`:
    it once stepped the vector env before resetting it (`SessionError`)."""
    pytest.importorskip("gymnasium")
    (block,) = [b for b in python_blocks(ROOT / "docs" / "CLIENTS.md") if "stadium.gym" in b]
    async with serve("gymnasium:CartPole-v1") as server:
        await asyncio.wait_for(asyncio.to_thread(run_block, block, server.url), 30 * UNIT)


def test_the_serving_embedding_example_runs() -> None:
    """docs/SERVING.md's "Embed it" block: a server in the program's own loop, a session on
    its ``url``, then ``stop`` (it was one line that showed neither the URL nor the stop)."""
    (block,) = [b for b in python_blocks(ROOT / "docs" / "SERVING.md") if "stadium.Server(" in b]
    assert run_block(block, "unused") == 1


#: ``stadium.X`` in the documents that are not Python names: WebSocket subprotocols, a
#: logger, file names.
NOT_PYTHON = {"batch", "batch.msgpack", "msgpack", "env", "deployment", "yaml"}


def _resolves(dotted: str) -> bool:
    """Whether ``stadium.<dotted>`` names something: a module, or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), -1, -1):
        try:
            obj: Any = importlib.import_module(".".join(["stadium", *parts[:cut]]))
        except ImportError:
            continue
        for part in parts[cut:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_every_stadium_name_the_documents_show_exists() -> None:
    """A ``stadium.X`` in README.md or docs/ names a module or attribute that exists
    (docs/TENANTS.md named a ``stadium.balance`` there never was)."""
    missing = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"(?<![\w/-])stadium\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text):
            name = match.group(1)
            if name not in NOT_PYTHON and not _resolves(name):
                missing.add(f"{path.name}: stadium.{name}")
    assert not missing, sorted(missing)


def _command(words: list[str]) -> tuple[click.Command, list[str]]:
    """The ``stadium`` (sub)command ``words`` start with, and the words naming it."""
    command: click.Command = cli
    used: list[str] = []
    for word in words:
        if not isinstance(command, click.Group):
            break
        sub = command.get_command(click.Context(command), word)
        if sub is None:
            break
        command, used = sub, [*used, word]
    return command, used


def test_every_option_a_documented_command_line_gives_exists() -> None:
    """Each ``stadium CMD ... --flag`` of README.md, BENCHMARKS.md and docs/ (inline code and
    code lines) gives options CMD has."""
    unknown, seen = set(), 0
    for path in [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        lines = re.findall(r"`(stadium [^`]+)`", text)
        lines += [
            s.strip() for s in text.splitlines() if re.match(r"\s*(\.venv/bin/)?stadium \w", s)
        ]
        for line in lines:
            command, used = _command(line.removeprefix(".venv/bin/").split()[1:])
            if not used or isinstance(command, click.Group):
                continue
            seen += 1
            options = {o for p in command.params for o in [*p.opts, *p.secondary_opts]}
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line.split(" #")[0]):
                if flag not in options | {"--help"}:
                    unknown.add(f"{path.name}: stadium {' '.join(used)} {flag}")
    assert seen > 100, seen
    assert not unknown, sorted(unknown)
