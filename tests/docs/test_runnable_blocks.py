"""The docs' runnable blocks run as written: every fenced block of README.md and docs/guide.md
marked with ``<!-- runnable -->`` on the line before its fence is executed, in document order,
against a real service with jobs on a real Ray head. Shell blocks and Python blocks share one
bash session (the virtual environment's ``bin`` first on PATH; a Python block runs as
``python - <<EOF``), so a block may use the variables and files an earlier one made.

What a document's blocks may assume is its preamble, stated in one line of the document:
``DPTUNE_URL`` and ``DPTUNE_OPERATOR_KEY`` for both, plus for the README ``DPTUNE_API_KEY``
(an analyst key) and digits registered as dataset 1. ``curl`` fails on an HTTP error here
(``--fail-with-body``), so a request the docs expect to succeed cannot fail unnoticed.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from service.api.server import free_port
from service.cluster import RayConnection, connect

from ..e2e.conftest import OPERATOR, Service, serving

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/guide.md")
MARK = "<!-- runnable -->"
SHELLS = ("bash", "sh")
LANGUAGES = (*SHELLS, "python")
#: a strict curl for the blocks: an HTTP error fails the command, its body still printed
STRICT_CURL = 'curl() { command curl --fail-with-body "$@"; }'
TIMEOUT_S = 240


@dataclass(frozen=True)
class Block:
    """A runnable fenced block: where it is (the fence's line, from 1), its language, code."""

    where: str
    language: str
    code: str


def runnable_blocks(text: str, name: str) -> list[Block]:
    """The blocks of a Markdown ``text`` marked runnable. A mark that is not followed by a
    fence, or a runnable block in a language the test cannot run, is an error."""
    tokens = MarkdownIt("commonmark").parse(text)
    blocks = []
    for mark, token in itertools.pairwise([*tokens, None]):
        if mark.type != "html_block" or mark.content.strip() != MARK:
            continue
        assert mark.map is not None
        where = f"{name}:{mark.map[0] + 1}"
        if token is None or token.type != "fence" or token.map is None:
            raise ValueError(f"{where}: {MARK} must be the line before a fenced block")
        language = token.info.split()[0] if token.info.strip() else ""
        if language not in LANGUAGES:
            raise ValueError(f"{where}: cannot run a {language or 'plain'} block")
        blocks.append(Block(f"{name}:{token.map[0] + 1}", language, token.content))
    return blocks


def script(blocks: list[Block]) -> str:
    """One bash script running ``blocks`` in order, stopping at the first failure; each block
    announces itself on stderr, so the output shows which one failed."""
    lines = ["set -eo pipefail", STRICT_CURL]
    for block in blocks:
        lines.append(f"echo '>>> {block.where}' >&2")
        if block.language == "python":
            lines.append(f"python - <<'DPTUNE_DOCS_PYTHON'\n{block.code}DPTUNE_DOCS_PYTHON")
        else:
            lines.append(block.code)
    return "\n".join(lines) + "\n"


def document_blocks(name: str) -> list[Block]:
    return runnable_blocks((ROOT / name).read_text(), name)


@pytest.mark.parametrize(
    ("name", "least"),
    [("README.md", {"python": 1, "bash": 1}), ("docs/guide.md", {"bash": 5})],
)
def test_the_documents_mark_runnable_blocks(name: str, least: dict[str, int]) -> None:
    """Unmarking everything cannot make the run below pass vacuously."""
    found = Counter(block.language for block in document_blocks(name))
    assert all(found[language] >= n for language, n in least.items()), found


@pytest.mark.parametrize(
    ("text", "languages"),
    [
        (f"{MARK}\n```bash\necho hi\n```\n", ["bash"]),
        (f"{MARK}\n```python title\nprint()\n```\n", ["python"]),
        (f"text\n\n{MARK}\n~~~sh\nls\n~~~\n\n```bash\nnot marked\n```\n", ["sh"]),
        (f"```bash\nls\n```\n{MARK}\n\n```python\nx = 1\n```\n", ["python"]),
        ("```bash\nls\n```\n<!-- other -->\n```bash\nls\n```\n", []),
        (f"- item\n\n  {MARK}\n  ```bash\n  ls\n  ```\n", ["bash"]),
    ],
)
def test_the_extractor_finds_marked_fences(text: str, languages: list[str]) -> None:
    assert [block.language for block in runnable_blocks(text, "t.md")] == languages


@pytest.mark.parametrize(
    "text",
    [f"{MARK}\nprose\n", f"{MARK}\n```json\n{{}}\n```\n", f"{MARK}\n```\nls\n```\n", MARK],
)
def test_a_mark_without_a_runnable_fence_is_an_error(text: str) -> None:
    with pytest.raises(ValueError, match=r"^t\.md:1: "):
        runnable_blocks(text, "t.md")


def test_the_script_stops_at_a_failing_block(tmp_path: Path) -> None:
    blocks = [
        Block("a.md:1", "bash", "echo one\n"),
        Block("a.md:5", "python", "import sys\nsys.exit('two failed')\n"),
        Block("a.md:9", "bash", "echo three\n"),
    ]
    result = run(script(blocks), tmp_path, dict(os.environ))
    assert result.returncode != 0
    assert ">>> a.md:5" in result.stdout and "two failed" in result.stdout
    assert "three" not in result.stdout


def run(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``code`` in bash; stdout and stderr together, as the blocks print them."""
    return subprocess.run(
        ["bash", "-c", code],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayConnection]:
    """A Ray head for this module alone (its own dashboard port), stopped when it is done."""
    connection = connect(
        tmp_path_factory.mktemp("ray"), dashboard_port=free_port(), num_cpus=2, num_gpus=0
    )
    yield connection
    connection.stop()


def readme_preamble(service: Service) -> dict[str, str]:
    """digits as dataset 1 and an analyst key for it."""
    dataset = service.post(
        "/v1/datasets",
        {"name": "digits", "source": "builtin:digits", "epsilon": 8.0, "delta": 1e-5},
    )
    assert dataset["id"] == 1, dataset
    key = service.post("/v1/keys", {"name": "ana", "role": "analyst", "datasets": [1]})
    return {"DPTUNE_API_KEY": key["secret"]}


PREAMBLES: dict[str, Callable[[Service], dict[str, str]]] = {
    "README.md": readme_preamble,
    "docs/guide.md": lambda service: {},
}


def environment(service: Service, extra: dict[str, str]) -> dict[str, str]:
    """The caller's environment without its dptune settings, the venv first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPTUNE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DPTUNE_URL"] = str(service.client.base_url).rstrip("/")
    env["DPTUNE_OPERATOR_KEY"] = OPERATOR["Authorization"].removeprefix("Bearer ")
    return env | extra


@pytest.mark.parametrize("name", DOCUMENTS)
def test_runnable_blocks_run_as_written(name: str, ray_head: RayConnection, tmp_path: Path) -> None:
    for tool in ("curl", "jq"):
        assert shutil.which(tool), f"the docs' shell blocks need {tool}: install it"
    work = tmp_path / "work"
    work.mkdir()
    with serving(ray_head, tmp_path / "data") as service:
        env = environment(service, PREAMBLES[name](service))
        try:
            result = run(script(document_blocks(name)), work, env)
        except subprocess.TimeoutExpired as error:
            output = error.output.decode() if isinstance(error.output, bytes) else error.output
            pytest.fail(f"{name}: blocks still running after {TIMEOUT_S} s:\n{output[-8000:]}")
    assert result.returncode == 0, f"{name}: a runnable block failed:\n{result.stdout[-8000:]}"
