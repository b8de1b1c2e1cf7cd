"""The README's tour runs as written against a real server, and every Python snippet of the README
and the docs passes the repository's own lint (a user copies them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tally_server.testing import RunningServer

REPO = Path(__file__).resolve().parents[2]
RUFF = Path(sys.executable).parent / "ruff"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A fragment continues the page's text: its names (``tally``, ``args``, ``process``) are defined
# around it, and ``...`` stands for what it leaves out (which may use a loop's variable). Everything
# else of the lint applies.
FRAGMENT_IGNORES = ["F821", "PIE790", "B007"]


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """Each ```python block of ``page``: the line it starts on, and its code."""
    text = page.read_text()
    return [
        (text[: m.start()].count("\n") + 2, m.group(1))
        for m in re.finditer(r"```python\n(.*?)```", text, re.S)
    ]


def lint(code: str, ignore: list[str]) -> subprocess.CompletedProcess[str]:
    """``ruff check`` of ``code`` with the repository's configuration, as a file at its root."""
    command = [str(RUFF), "check", "--config", str(REPO / "pyproject.toml"), "--output-format", "concise"]
    command += [f"--extend-ignore={','.join(ignore)}"] if ignore else []
    command += ["--stdin-filename", str(REPO / "snippet.py"), "-"]
    return subprocess.run(command, input=code, capture_output=True, text=True, cwd=REPO, timeout=60)


def worker_script() -> str:
    readme = (REPO / "README.md").read_text()
    tour = readme.split("**2. Run a worker**", 1)[1]
    match = re.search(r"```python\n(.*?)```", tour, re.S)
    assert match, "the tour's worker script is missing"
    return match.group(1)


def test_readme_worker_runs_then_skips_everything(server: RunningServer, tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(worker_script())
    env = {**os.environ, "TALLY_ADDRESS": server.grpc_address}
    outputs = [
        subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
        for _ in range(2)
    ]
    assert [o.returncode for o in outputs] == [0, 0], [o.stderr for o in outputs]
    assert outputs[0].stdout.strip() == "processed 10, skipped 0"
    assert outputs[1].stdout.strip() == "processed 0, skipped 10"
    status = httpx.get(f"{server.http_url}/v1/checkpoints/demo/run-1").json()
    assert status["name"] == "demo/run-1"
    assert (status["completed_count"], status["live_writers"], status["pending_sources"]) == (10, 0, 0)


def test_the_tour_worker_passes_the_whole_lint() -> None:
    """The worker is a whole file a user saves: nothing is excused (B905, ``zip()`` without
    ``strict=``, was once in it)."""
    result = lint(worker_script(), [])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("page", DOCS, ids=[str(p.relative_to(REPO)) for p in DOCS])
def test_every_python_snippet_passes_the_lint(page: Path) -> None:
    failures = []
    for line, code in python_blocks(page):
        result = lint(code, FRAGMENT_IGNORES)
        if result.returncode != 0:
            failures.append(f"{page.relative_to(REPO)}:{line}:\n{result.stdout}{result.stderr}")
    assert not failures, "\n".join(failures)


def test_the_readme_has_the_snippets_these_tests_lint() -> None:
    # Guards the two tests above against checking nothing after an edit of the page's layout.
    assert len(python_blocks(REPO / "README.md")) >= 2
    assert "import tally" in worker_script()


def test_dev_tally_runs_the_readme_s_cli_commands(server: RunningServer) -> None:
    """The README says to run ``tally`` as ``./dev tally`` in a checkout (it is not on PATH)."""
    venv, stamp = REPO / ".venv", REPO / ".venv" / ".installed-dev"
    projects = [
        REPO / "pyproject.toml",
        REPO / "client" / "pyproject.toml",
        REPO / "server" / "pyproject.toml",
    ]
    current = stamp.exists() and all(p.stat().st_mtime <= stamp.stat().st_mtime for p in projects)
    if Path(sys.prefix).resolve() != venv.resolve() or not current:
        pytest.skip(
            "runs only in the checkout's .venv as ./dev test left it (./dev tally would reinstall it)"
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    env["TALLY_ADDRESS"] = server.grpc_address
    result = subprocess.run(
        [str(REPO / "dev"), "tally", "status"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "no checkpoints" in result.stdout.lower()
    assert "./dev tally status" in (REPO / "README.md").read_text()


def shell_blocks(page: Path, section: str) -> list[str]:
    """The ```sh blocks of ``section`` (a ``## `` heading) of ``page``."""
    text = page.read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def test_the_slurm_trial_without_slurm_runs_as_written(server: RunningServer, tmp_path: Path) -> None:
    """docs/slurm.md's hand-played array: the input it makes, four tasks crashing after one file each,
    then the rest. Only the paths and the address are this test's own."""
    make_input, crashing, rest = shell_blocks(REPO / "docs" / "slurm.md", "Trying it without SLURM")

    def run(block: str) -> str:
        block = block.replace("/tmp/in", str(tmp_path / "in")).replace("/tmp/out", str(tmp_path / "out"))
        block = block.replace("127.0.0.1:50051", server.grpc_address).replace(
            ".venv/bin/python", sys.executable
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TALLY_", "SLURM_"))}
        result = subprocess.run(
            ["bash", "-c", block], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def completed() -> int:
        status = httpx.get(f"{server.http_url}/v1/checkpoints/demo/array").json()
        return int(status["completed_count"])

    run(make_input)
    assert len(list((tmp_path / "in").glob("*.txt"))) == 12
    out = run(crashing)
    assert out.count("crashing after 1 source") == 4, out
    assert completed() == 4
    out = run(rest)
    # Four processes share the pipe: their lines may interleave, so each is looked for on its own.
    assert sorted(re.findall(r"task (\d)/4: 3 sources, 1 completed", out)) == ["0", "1", "2", "3"], out
    assert completed() == 12
    assert len(list((tmp_path / "out").glob("*.txt"))) == 24  # two non-empty lines per file
