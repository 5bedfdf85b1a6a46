"""Docs that run: every code block in ``docs/`` executes, and the site builds with ``--strict``.

Each page runs as a reader would follow it: its ```` ```python ````, ```` ```bash ```` and
```` ```console ```` blocks in document order, in one fresh temporary directory (the working
directory), the python blocks sharing one namespace, the bash blocks run by ``bash -e`` with this
interpreter's ``bin`` first on ``PATH`` (so ``python`` and the ``layoutckpt`` command are the
installed ones). A console block is a transcript: each ``$ command`` line runs there too, and
what it prints (stdout and stderr together, as a terminal shows them) must be the lines that
follow it, but for trailing spaces. A page may rely only on what its own earlier blocks made.
```` ```json ```` blocks must parse; any other fence (``text``, ``toml``) is illustration and
does not run.

A page whose text mentions ``s3://`` runs with a real S3 server on loopback (moto) holding the
bucket ``my-bucket``, configured through the ``AWS_*`` variables a user would set.

There is one test per block, named after its page and position (``howto/resume.md-3-python``).
Running a block runs the page's earlier blocks first if they have not run yet, so any block can
be selected on its own with ``-k``; when an earlier block failed, the later ones fail saying so.
"""

from __future__ import annotations

import difflib
import gc
import html
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

import layoutckpt
from tests.support.paths import REPO as ROOT
from tests.support.s3server import S3Server

DOCS = ROOT / "docs"
RUNNABLE = ("python", "bash", "console")
# A fence opens at any indentation (inside a list item, say) and closes at the same one.
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
BASH_TIMEOUT = 180


@attrs.frozen
class Block:
    page: str  # relative to docs/, with forward slashes
    index: int  # position among the page's runnable blocks
    lang: str
    line: int  # 1-based line of the block's first line of code
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}-{self.index}-{self.lang}"


def pages() -> list[Path]:
    return sorted(DOCS.glob("**/*.md"))


def blocks(page: Path, langs: tuple[str, ...]) -> list[Block]:
    return blocks_in(page.read_text(), page.relative_to(DOCS).as_posix(), langs)


def blocks_in(text: str, page: str, langs: tuple[str, ...]) -> list[Block]:
    found = []
    for match in FENCE.finditer(text):
        if match.group("lang") not in langs:
            continue
        line = text.count("\n", 0, match.start("body")) + 1
        code = textwrap.dedent(match.group("body"))
        found.append(Block(page, len(found), match.group("lang"), line, code))
    return found


RUN_BLOCKS = [b for page in pages() for b in blocks(page, RUNNABLE)]
JSON_BLOCKS = [b for page in pages() for b in blocks(page, ("json",))]
LAST_INDEX = {b.page: b.index for b in RUN_BLOCKS}


@attrs.define
class PageRun:
    """One page's progress: its directory, its python namespace, the blocks run so far, and what
    the page was given for its run (an S3 server, and the environment to restore after it)."""

    directory: Path
    namespace: dict[str, Any] = attrs.field(factory=lambda: {"__name__": "__docs__"}, repr=False)
    done: int = 0
    failed: str | None = None
    server: S3Server | None = None
    saved_env: dict[str, str | None] = attrs.field(factory=dict)
    closed: bool = False

    @classmethod
    def start(cls, page: str, directory: Path) -> PageRun:
        run = cls(directory)
        if "s3://" in (DOCS / page).read_text():
            # Pages about object storage use s3://my-bucket: a real S3 server on loopback (moto),
            # configured through the variables a user would set, for this page only.
            run.server = S3Server()
            run.server.create_bucket("my-bucket")
            run.saved_env = {k: os.environ.get(k) for k in run.server.env}
            run.server.apply()
        return run

    def close(self) -> None:
        """Undo what the page may leave in this process that would change the next page."""
        if self.closed:
            return
        self.closed = True
        # Collect the page's objects now: an error in a finalizer is then reported by this
        # page's last block, not by whichever later test the garbage collector happens to run in.
        self.namespace.clear()
        gc.collect()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if self.server is not None:
            self.server.stop()
            for key, value in self.saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(scope="module")
def page_runs() -> Iterator[dict[str, PageRun]]:
    runs: dict[str, PageRun] = {}
    yield runs
    for run in runs.values():
        run.close()


def _run_python(block: Block, run: PageRun) -> None:
    # Pad with newlines so that tracebacks point at the line of the page.
    source = "\n" * (block.line - 1) + block.code
    exec(compile(source, str(DOCS / block.page), "exec"), run.namespace)


def _run_bash(block: Block, run: PageRun) -> None:
    proc = subprocess.run(
        ["bash", "-e", "-c", block.code],
        cwd=run.directory,
        env=_shell_env(),
        capture_output=True,
        text=True,
        timeout=BASH_TIMEOUT,
        check=False,
    )
    print(proc.stdout, end="")
    if proc.returncode != 0:
        pytest.fail(
            f"docs/{block.page}, bash block at line {block.line} exited {proc.returncode}:\n"
            f"--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}",
            pytrace=False,
        )


def _shell_env() -> dict[str, str]:
    bin_dir = os.path.dirname(sys.executable)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "GLOO_SOCKET_IFNAME": "lo"}


def transcript(block: Block) -> list[tuple[str, list[str]]]:
    """(command, the lines it prints) of each ``$ `` line of a console block."""
    steps: list[tuple[str, list[str]]] = []
    for line in block.code.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif not steps:
            pytest.fail(f"docs/{block.page}, console block at line {block.line}: starts without a `$ ` line")
        else:
            steps[-1][1].append(line.rstrip())
    return steps


def _run_console(block: Block, run: PageRun) -> None:
    # Unbuffered, so that stdout and stderr interleave as on a terminal.
    env = {**_shell_env(), "PYTHONUNBUFFERED": "1"}
    for command, expected in transcript(block):
        proc = subprocess.run(
            ["bash", "-c", command],
            cwd=run.directory,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=BASH_TIMEOUT,
            check=False,
        )
        got = [line.rstrip() for line in proc.stdout.rstrip("\n").splitlines()]
        if got != expected:
            diff = "\n".join(difflib.unified_diff(expected, got, "docs", "printed", lineterm=""))
            pytest.fail(
                f"docs/{block.page}, console block at line {block.line}: `{command}` prints\n{diff}", pytrace=False
            )


RUNNERS = {"python": _run_python, "bash": _run_bash, "console": _run_console}


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.id for b in RUN_BLOCKS])
def test_block_runs(block: Block, page_runs: dict[str, PageRun], tmp_path_factory, monkeypatch):
    run = page_runs.get(block.page)
    if run is None:
        for other in page_runs.values():
            other.close()  # a page that failed before its last block left its resources
        directory = tmp_path_factory.mktemp(re.sub(r"\W", "_", block.page))
        run = page_runs[block.page] = PageRun.start(block.page, directory)
    if run.failed is not None:
        pytest.fail(f"not run: an earlier block of docs/{block.page} failed ({run.failed})", pytrace=False)
    monkeypatch.chdir(run.directory)
    # Run what the page has not run yet, up to this block (all of it when selected alone with -k).
    for earlier in [b for b in RUN_BLOCKS if b.page == block.page][run.done : block.index + 1]:
        try:
            RUNNERS[earlier.lang](earlier, run)
        except BaseException:
            run.failed = f"block {earlier.index} at line {earlier.line}"
            raise
        run.done = earlier.index + 1
    if block.index == LAST_INDEX[block.page]:
        run.close()


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=[b.id for b in JSON_BLOCKS])
def test_json_block_parses(block: Block):
    json.loads(block.code)


def test_blocks_are_found():
    """The fence parser sees the pages' blocks (a parser that saw none would pass every page)."""
    assert len(RUN_BLOCKS) >= 10
    assert {"index.md", "concepts.md", "howto/resume.md", "howto/partial-reads.md"} <= {b.page for b in RUN_BLOCKS}
    assert any(b.lang == "bash" for b in RUN_BLOCKS)
    assert sum(b.lang == "console" for b in RUN_BLOCKS) >= 5
    nested = blocks_in("- item\n\n    ```python\n    x = 1\n    ```\n\n```text\ny\n```\n", "t.md", RUNNABLE)
    assert [(b.lang, b.code, b.line) for b in nested] == [("python", "x = 1\n", 4)]


def _public_api() -> list[str]:
    """Every public class and function of ``layoutckpt`` (the two constants are described in prose)."""
    return sorted(n for n in dir(layoutckpt) if not n.startswith("_") and callable(getattr(layoutckpt, n)))


def test_mkdocs_builds_strict_with_the_api_reference(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}{proc.stderr}"
    api = html.unescape((site / "api" / "index.html").read_text())
    # Every public name has an entry, rendered from its docstring.
    expected = [f"layoutckpt.{n}" for n in _public_api()] + ["layoutckpt.jax.load", "layoutckpt.jax.load_array"]
    missing = [n for n in expected if f'id="{n}"' not in api]
    assert not missing, f"docs/api.md lacks entries for {missing}"
    text = html.unescape(re.sub(r"<[^>]+>", "", (site / "api" / "index.html").read_text()))
    assert "Save this rank's shards of state under layout" in text
    assert "Open a committed checkpoint for lazy reading in a single process." in api
    # Doctests in docstrings render as code (highlighted: tags between the tokens), with the
    # regex's backslashes intact.
    assert '>>> layout = Layout(Mesh({"tp": 2}), [(r"\\.q_proj\\.weight$"' in text
    assert '<span class="gp">&gt;&gt;&gt; </span>' in (site / "api" / "index.html").read_text()
    # Code is highlighted at build time, and no page loads a script or stylesheet from elsewhere:
    # the site reads the same offline.
    index = (site / "index.html").read_text()
    assert '<span class="kn">import</span>' in index and "assets/pygments.css" in index
    assert '<span class="gp">$ </span>' in (site / "howto" / "cli" / "index.html").read_text()
    remote = re.compile(r'<(?:script|link|img)\b[^>]*\b(?:src|href)="(?:https?:)?//[^"]*"')
    fetched = {m for page in site.glob("**/*.html") for m in remote.findall(page.read_text())}
    assert not fetched, f"the site loads from the network: {sorted(fetched)[:5]}"
    # Every page is built (none silently left out of the site).
    built = {p.relative_to(DOCS).with_suffix("").as_posix() for p in pages()}
    for name in built:
        page = name.removesuffix("index")  # an index.md is its folder's page
        target = site / (f"{page}index.html" if page != name else f"{name}/index.html")
        assert target.is_file(), f"docs/{name}.md was not built"
