"""docs/nemo-curator.md runs top to bottom as written: its code blocks, taken from the page (so an edit
that breaks the guide fails here), run in the page's order against a real coordinator, a private Ray
head and the real NeMo Curator 1.4.0 of ``.venv-nemo``.

The walk changes the guide's text in these ways only:

1. ``coordinator:50051`` becomes the test's coordinator (``127.0.0.1:<the port it picked>``).
2. ``/data/...`` becomes the same path under the test's tmp dir (``<tmp>/data/...``).
3. Section 1's ``./dev serve`` runs as written, from this checkout (``./dev`` itself, not the
   ``running_server`` fixture's ``tally serve``: ``running_server(command=[".../dev", "serve"])``),
   with its ``--grpc-listen 0.0.0.0:50051`` made ``127.0.0.1:0`` (loopback, a free port) and
   ``--http-listen 127.0.0.1:0 --data-dir <tmp>`` added, plus ``running_server``'s
   ``--settle-ms 250 --lease-ttl-s 30``, the defaults.
4. Section 2's ``pip install`` lines are not run: each must be what tests/nemo/setup_env.sh installs
   into ``.venv-nemo``, in the same order, and ``.venv-nemo`` must hold them (and no ``tally-server``).
5. Section 3's ``ray start`` line keeps its variables and flags; ``ray_head`` adds ``--block``,
   ``--node-ip-address=127.0.0.1``, ``--disable-usage-stats``, its temp dir and free loopback ports,
   and runs it in its private environment (own ``HOME`` and temp dir, ``RAY_AUTH_MODE=disabled``, no
   inherited ``RAY_*``: see ``nemo_cluster.private_env``). The ``export RAY_ADDRESS=127.0.0.1:6379``
   line gets the port ``ray start`` printed instead of 6379.
6. Commands run as in an activated ``.venv-nemo``: ``ray`` and ``tally`` are ``.venv-nemo/bin``'s
   (only the client is installed there); ``PYTHONPATH`` is this checkout's ``client/src`` (the
   environment's editable install may point at another checkout).
7. Section 4's Python block is the pipeline script, written to a file and run with
   ``.venv-nemo/bin/python`` and the ``RAY_ADDRESS`` of the ``export`` line. Section 5 says to run
   the same script again: the walk does. Section 6's Python line replaces the script's ``with`` block.
8. "Recording a trace": its ``with`` block replaces the script's, with ``curation/run-42`` made
   ``curation/traced`` (a checkpoint of its own, so the traced run has work to do); the replay's
   completions must be the ones the coordinator holds.

``tally watch`` never ends by itself (not on a finished checkpoint either): the walk reads its first
line, checks it is still running, and stops it with Ctrl-C (SIGINT), which it must take as a normal end.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import tally
from tally_server.testing import RunningServer, running_server
from tests.nemo.nemo_cluster import (
    MARKER,
    NEMO_PYTHON,
    REPO,
    TIMINGS,
    VENV,
    Driver,
    ray_head,
    records,
    require_env,
)

GUIDE = REPO / "docs" / "nemo-curator.md"
SETUP_ENV = REPO / "tests" / "nemo" / "setup_env.sh"
CHECKPOINT = "curation/run-42"
TRACED = "curation/traced"  # the trace section's run, on a checkpoint of its own (substitution 8)
FILES = [f"part-{i}.jsonl" for i in range(4)]
RECORDS_PER_FILE = 3

pytestmark = [pytest.mark.nemo, pytest.mark.timeout(600)]


@dataclass
class Block:
    section: str  # the ``## `` heading it is under
    lang: str  # the fence's language ("" for none)
    code: str
    line: int  # where it starts in the page

    def commands(self) -> list[str]:
        """A shell block's command lines (comment lines dropped; a trailing comment stays: bash drops it)."""
        return [line for line in self.code.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def guide_blocks() -> list[Block]:
    text = GUIDE.read_text()
    blocks = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M):
        before = text[: m.start()]
        sections = re.findall(r"^## (.+)$", before, re.M)
        blocks.append(Block(sections[-1] if sections else "", m.group(1), m.group(2), before.count("\n") + 1))
    return blocks


# Every block of the page, in order: the walk runs each one or says here why not. A block added,
# removed or moved fails the test until the walk covers it.
WALK = [
    ("1. Start a coordinator", "sh", "run: ./dev serve"),
    ("2. Install", "sh", "checked against tests/nemo/setup_env.sh"),
    ("3. Start Ray", "sh", "run: ray start, export RAY_ADDRESS"),
    ("3. Start Ray", "", "not a command: the drop-in's error, checked by test_nemo_curator_real.py"),
    ("4. Run the pipeline", "python", "run: the pipeline script"),
    ("4. Run the pipeline", "sh", "run: tally status, watch, remaining"),
    ("6. Moving between Tally", "sh", "run: tally export --markers-from"),
    ("6. Moving between Tally", "python", "run: the script, this line instead of its with block"),
    ("6. Moving between Tally", "sh", "run: tally import"),
    ("Recording a trace", "python", "run: the script, this with block instead of its own, on TRACED"),
    ("Recording a trace", "sh", "run: tally replay, text and JSON"),
    ("How it is tested", "sh", "not walked: the command that runs this test"),
]


def walked_blocks() -> list[Block]:
    """The page's code blocks, checked to be the ones ``WALK`` lists, in its order."""
    blocks = guide_blocks()
    found = [(b.section, b.lang, b.line) for b in blocks]
    assert len(found) == len(WALK) and all(
        section.startswith(prefix) and lang == want
        for (section, lang, _), (prefix, want, _) in zip(found, WALK, strict=False)
    ), (
        f"docs/nemo-curator.md's code blocks (heading, language, line) changed; update WALK in "
        f"{__file__}:\n{found}"
    )
    return blocks


def test_the_walk_covers_every_block_of_the_guide() -> None:
    walked_blocks()


def test_the_install_lines_are_what_setup_env_installs() -> None:
    """Section 2 is not run (it would download NeMo Curator): ``.venv-nemo`` was built by
    setup_env.sh, which must install exactly the guide's packages in the guide's order."""
    require_env()
    guide = [shlex.split(line, comments=True) for line in walked_blocks()[1].commands()]
    assert all(words[:2] == ["pip", "install"] for words in guide), guide
    wanted = [words[2:] for words in guide]
    script = SETUP_ENV.read_text()
    installed = [
        [w for w in shlex.split(m.group(1), comments=True) if w != "-e"]
        for m in re.finditer(r'^"\$\{PIP\[@\]\}" (.*)$', script, re.M)
    ]
    assert wanted == installed == [["torch==2.13.0"], ["nemo-curator==1.4.0"], ["./client[cli]"]]
    check = (
        "import importlib.metadata as m, importlib.util as u\n"
        "print(m.version('torch').split('+')[0], m.version('nemo-curator'), m.version('tally-client'))\n"
        "print(all(u.find_spec(n) for n in ('typer', 'rich', 'lmdb')), u.find_spec('tally_server') is None)\n"
    )
    result = subprocess.run([str(NEMO_PYTHON), "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2.13.0", "1.4.0", "0.1.0", "True", "True"]


def _require_dev_venv() -> None:
    """``./dev serve`` installs Tally into the checkout's ``.venv`` unless ``./dev test`` (or an earlier
    ``./dev serve``) did since the last change of a pyproject: a test must not do that."""
    projects = [
        REPO / "pyproject.toml",
        REPO / "client" / "pyproject.toml",
        REPO / "server" / "pyproject.toml",
    ]
    stamps = [REPO / ".venv" / ".installed-dev", REPO / ".venv" / ".installed-runtime"]
    newest = max(p.stat().st_mtime for p in projects)
    if any(s.exists() and s.stat().st_mtime >= newest for s in stamps):
        return
    reason = "./dev serve would reinstall the checkout's .venv first: run ./dev test (or ./dev serve) once"
    if os.environ.get("CI"):
        pytest.fail(f"CI must walk the NeMo Curator guide, but {reason}")
    pytest.skip(reason)


@contextlib.contextmanager
def _coordinator(block: Block, data_dir: Path) -> Iterator[RunningServer]:
    (line,) = block.commands()
    words = shlex.split(line, comments=True)
    assert words[:2] == ["./dev", "serve"], line
    flags = dict(zip(words[2::2], words[3::2], strict=True))
    assert flags == {"--grpc-listen": "0.0.0.0:50051"}, f"section 1 changed: {line}"
    with running_server(
        data_dir, command=[str(REPO / "dev"), "serve"], grpc_listen="127.0.0.1:0", http_listen="127.0.0.1:0"
    ) as server:
        yield server


def _snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under ``folder``: its mtime and bytes (a rewritten file changes its mtime)."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _first_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no output in {timeout} s"
    return process.stdout.readline()


def test_the_nemo_curator_guide_runs_top_to_bottom(tmp_path: Path) -> None:
    require_env()
    blocks = walked_blocks()
    _require_dev_venv()
    data = tmp_path / "data"
    data.mkdir()
    with _coordinator(blocks[0], tmp_path / "tally-data") as coordinator:
        address = coordinator.grpc_address
        assert address.startswith("127.0.0.1:")  # the port the server picked

        def sub(text: str) -> str:
            return text.replace("coordinator:50051", address).replace("/data/", f"{data}/")

        # 3. Start Ray: the head as written, with its variables; then the driver's RAY_ADDRESS.
        ray_line, export_line = blocks[2].commands()
        words = shlex.split(ray_line, comments=True)
        assignments = [w for w in words if re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w)]
        command = words[len(assignments) :]
        assert command[:3] == ["ray", "start", "--head"], ray_line
        path = f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}"
        ray = shutil.which(command[0], path=path)
        assert ray == str(VENV / "bin" / "ray")
        start_env = dict(a.split("=", 1) for a in assignments)
        with ray_head(limit_variable=False, start=[ray, *command[1:]], start_env=start_env) as ray_env:
            port = ray_env["RAY_ADDRESS"].rsplit(":", 1)[1]
            # `ray start` prints the node's address (this machine's IP): the guide's 127.0.0.1 is
            # for the head's own machine, with the port it printed.
            printed = (Path(ray_env[MARKER]) / "ray-start.log").read_text()
            assert re.search(rf"ray start --address='[\d.]+:{port}'", printed), printed[-3000:]
            match = re.fullmatch(r"export RAY_ADDRESS=(127\.0\.0\.1):6379\s+#.*", export_line)
            assert match, export_line
            env = {k: v for k, v in ray_env.items() if not k.startswith("TALLY_")}
            env.update(
                RAY_ADDRESS=f"{match.group(1)}:{port}",
                PATH=path,
                PYTHONPATH=str(REPO / "client" / "src"),
            )
            assert shutil.which("tally", path=path) == str(VENV / "bin" / "tally")
            _walk(blocks, sub, env, tmp_path, data, address)


def _bash(line: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", line], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def _walk(
    blocks: list[Block],
    sub: Callable[[str], str],
    env: dict[str, str],
    tmp_path: Path,
    data: Path,
    address: str,
) -> None:
    client = tally.Client(address)

    # 4. The pipeline script reads /data/in: some small JSONL inputs there.
    script_text = sub(blocks[4].code)
    inputs = data / "in"
    assert f'file_paths="{inputs}"' in script_text
    inputs.mkdir()
    rows = {
        name: [{"id": f"{name}-{r}", "text": f"record {r} of {name}"} for r in range(RECORDS_PER_FILE)]
        for name in FILES
    }
    for name, file_rows in rows.items():
        (inputs / name).write_text("".join(json.dumps(row) + "\n" for row in file_rows))
    # FanOut makes parts 0, 1, 2 of every partition; DropSome drops part 1.
    expected = collections.Counter(
        json.dumps({**row, "part": k}, sort_keys=True)
        for file_rows in rows.values()
        for row in file_rows
        for k in (0, 2)
    )
    script = tmp_path / "guide" / "pipeline.py"
    script.parent.mkdir()
    script.write_text(script_text)

    def run(label: str, path: Path) -> int:
        """Run a pipeline script; how many tasks reached the end of the pipeline (NeMo Curator's log)."""
        start = time.monotonic()
        driver = Driver(env, tmp_path / f"{label}.log", [], script=path)
        driver.wait()
        TIMINGS[label] = time.monotonic() - start
        done = re.findall(r"Pipeline completed successfully with (\d+) output tasks", driver.tail())
        assert len(done) == 1, driver.tail()
        return int(done[0])

    # Every partition's two surviving parts are written.
    assert run("run 1 (section 4)", script) == 2 * len(FILES)
    output, checkpoint_path = data / "out", data / "checkpoint"
    assert records(output) == expected
    status = client.checkpoint(CHECKPOINT)
    assert (status.completed_count, status.total, status.remaining) == (len(FILES), len(FILES), 0)
    completed = set(client.completed(CHECKPOINT))
    assert len(completed) == len(FILES)
    # NeMo Curator created checkpoint_path and wrote no completion file there (no SLURM array here).
    assert checkpoint_path.is_dir() and _snapshot(checkpoint_path) == {}

    # 4. tally status / watch / remaining, as written, from .venv-nemo's tally.
    status_line, watch_line, remaining_line = (sub(c) for c in blocks[5].commands())
    shown = _bash(status_line, env, tmp_path)
    assert shown.returncode == 0, shown.stderr
    fields = {k: v.strip() for k, v in re.findall(r"^(\w[\w ]*?)\s{2,}(.*)$", shown.stdout, re.M)}
    assert fields["checkpoint"] == CHECKPOINT
    assert (fields["completed"], fields["remaining"], fields["live writers"]) == ("4", "0", "0")
    assert fields["total"] == "4 declared (100.0 % completed)"
    left = _bash(remaining_line, env, tmp_path)
    assert left.returncode == 0, left.stderr
    assert (left.stdout, left.stderr.strip()) == ("", f"0 remaining sources of {CHECKPOINT} (of 4 declared)")
    watch = subprocess.Popen(
        ["bash", "-c", watch_line],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        first = _first_line(watch, timeout=60)
        assert first.startswith(f"{CHECKPOINT}: completed 4 of 4 (100.0 %)  pending 0  live writers 0"), first
        assert first.rstrip().endswith("remaining 0  ETA done"), first
        with pytest.raises(subprocess.TimeoutExpired):  # a finished checkpoint does not end it
            watch.wait(timeout=3)
        os.killpg(watch.pid, signal.SIGINT)  # Ctrl-C
        assert watch.wait(timeout=30) == 0
    finally:
        if watch.poll() is None:
            os.killpg(watch.pid, signal.SIGKILL)
            watch.wait(30)
        assert watch.stdout is not None
        watch.stdout.close()

    # 5. Run the same script again: every partition is skipped, nothing is written.
    before = _snapshot(output)
    assert run("run 2 (section 5, the same script again)", script) == 0
    assert _snapshot(output) == before
    assert set(client.completed(CHECKPOINT)) == completed
    writers = client.writers(CHECKPOINT, include_closed=True)
    assert len(writers) == 2

    # 6. Export with --markers-from, then plain NeMo Curator from the export: nothing to do.
    (export_line,) = (sub(c) for c in blocks[6].commands())
    exported = _bash(export_line, env, tmp_path)
    assert exported.returncode == 0, exported.stderr
    export_folder = data / "checkpoint-from-tally"
    target = export_folder / ".nemo_curator_metadata" / "tally-export.mdb"
    assert f"exported 4 completed sources of {CHECKPOINT} to {target}" in exported.stdout, exported.stdout
    assert target.is_file()
    # No SLURM array here: /data/checkpoint holds no markers, which the command says, and goes on.
    assert f"--markers-from {checkpoint_path}: no NeMo Curator markers" in exported.stderr, exported.stderr
    plain_line = sub(blocks[7].code).strip()
    with_block = re.compile(r"^with tally_for_nemo_curator\((?:.|\n)*?\):\n    pipeline\.run\(.*\)\n", re.M)
    plain_text, replaced = with_block.subn(plain_line + "\n", script_text)
    assert replaced == 1, "the script's with block is not the two lines section 6 replaces"
    plain = script.with_name("plain.py")
    plain.write_text(plain_text)
    assert run("run 3 (section 6, plain NeMo Curator)", plain) == 0
    assert _snapshot(output) == before
    assert len(client.writers(CHECKPOINT, include_closed=True)) == 2  # no Tally involved
    # NeMo Curator's own actor ran there: it added its (empty) file next to the export, as the guide says.
    assert len([p for p in target.parent.glob("*.mdb") if p != target]) == 1

    # 6. Import the folder plain NeMo Curator resumed from, as a new checkpoint: the same completed set.
    (import_line,) = (sub(c) for c in blocks[8].commands())
    imported = _bash(import_line, env, tmp_path)
    assert imported.returncode == 0, imported.stderr
    name = re.search(r"--as (\S+)", import_line)
    assert name and name.group(1) != CHECKPOINT, import_line
    assert re.fullmatch(
        rf"imported 4 new of 4 completed sources into {re.escape(name.group(1))} "
        r"\(file imported-\d+\.mdb\); completed count now 4\n",
        imported.stdout,
    ), imported.stdout
    assert set(client.completed(name.group(1))) == completed

    # Recording a trace: the section's with block in the script, then tally replay of the file.
    trace = data / "run-42-trace.jsonl"
    traced_block = sub(blocks[9].code).replace(f'"{CHECKPOINT}"', f'"{TRACED}"')
    assert f'trace="{trace}"' in traced_block, traced_block
    traced_text, replaced = with_block.subn(traced_block, script_text)
    assert replaced == 1, "the script's with block is not one the trace section's replaces"
    traced = script.with_name("traced.py")
    traced.write_text(traced_text)
    assert run("run 4 (recording a trace)", traced) == 2 * len(FILES)
    traced_completed = set(client.completed(TRACED))
    assert len(traced_completed) == len(FILES)
    text_line, json_line = (sub(c) for c in blocks[10].commands())
    replayed = _bash(text_line, env, tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "DIFFERS" not in replayed.stdout and " 0 rows differ" in replayed.stdout, replayed.stdout
    as_json = _bash(json_line, env, tmp_path)
    assert as_json.returncode == 0, as_json.stderr
    document = json.loads(as_json.stdout)
    assert document["mismatches"] == [] or document["mismatches"] == 0, document["mismatches"]
    (traced_run,) = document["runs"]
    assert traced_run["checkpoint"] == TRACED
    # What the rules complete from the recorded deltas is what the coordinator completed.
    assert set(traced_run["summary"]["completed"]) == traced_completed
    assert traced_run["summary"]["pending"] == {}
    client.close()
