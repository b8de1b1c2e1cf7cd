"""The anchor side of ``bench/compare.py``: NeMo Curator 1.4.0's real ResumabilityActor, through Ray.

Runs under ``.venv-nemo`` (``tests/nemo/setup_env.sh``), never imports Tally. ``compare.py`` starts
it with a private HOME and temp dir and talks to it in JSON lines: one request per line on stdin,
one answer per line on the stdout it was started with (everything else the process or Ray prints
goes to stderr). It starts a local Ray instance of its own at start and stops it on ``quit``.

    {"cmd": "throughput", "mode": "ray", "actors": 4, "writers": 4, "sources": 25000,
     "complete": true, "dir": "/tmp/..."}      -> {"seconds", "deltas", "completed", "cpu_s", "anomalies"}
    {"cmd": "rerun", "mode": ..., "actors": ..., "writers": ..., "sources": ..., "dir": ...}
                                               -> the same, for the second of two runs (below)
    {"cmd": "latency", "samples": 2000, "warmup": 100, "dir": ...}
                                               -> {"are_completed_ms": [...], "apply_flush_ms": [...]}
    {"cmd": "load", "dir": ..., "empty_dir": ..., "count": N, "queries": Q}
                                               -> {"ready_s", "first_answer_s", "rss", ...}
    {"cmd": "daemons"}                         -> {"rss", "processes"}
    {"cmd": "quit"}

How NeMo Curator calls the actor, and what is measured the same way here: its stages fire
``actor.apply_deltas.remote(per_task)`` and never wait for it
(``nemo_curator.utils.resumability_client.flush_resumability_deltas``); the actor runs one call at
a time, in the order each caller sent them, and each call that completes sources commits them in
a synced LMDB write transaction before it returns. So a source is durable when the call that
completed it returns, and a writer's last batch is durable when a later call of the same writer
(the actor's no-op ``wait``) comes back: that is the anchor's ``flush()``.

A rerun over completed sources: the same deltas, completing every source, run twice on one folder;
the second run (the one measured) by new actors, of new writer ids, as a new pipeline run would
start them. Each of them loads the union of the folder's files, so every source's first delta is
an anomaly: the actor logs a warning ("... Removing '<id>' from the completed set ..."), drops the
delta and un-completes the source in memory and in its own file (a synced LMDB write transaction).
The actor keeps no count of them: a loguru sink in the actor's process counts those warnings.
"""

from __future__ import annotations

import gc
import inspect
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Answers go to the stdout we were started with; anything else printed (Ray, NeMo's loguru) goes
# to stderr so that it can never be mistaken for an answer.
_ANSWERS = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import _workload as wl  # noqa: E402  (after the redirection, on purpose)
import ray  # noqa: E402
from nemo_curator.utils.resumability_actor import ResumabilityActor  # noqa: E402

MAX_WRITERS = 4
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The actor's own class, without Ray: what ``@ray.remote`` wrapped.
InProcessActor: Any = ResumabilityActor.__ray_metadata__.modified_class.__bases__[0]  # type: ignore[attr-defined]
assert InProcessActor.__name__ == "ResumabilityActor", InProcessActor


@ray.remote(num_cpus=0)
class BenchWriter:
    """One writer (a pipeline worker): holds its deltas, fires them at an actor like NeMo does."""

    def prepare(self, writer: int, sources: int, complete: bool) -> int:
        self._sids = wl.writer_sources(writer, sources)
        self._batches = wl.batches(wl.writer_deltas(writer, sources, complete=complete))
        return sum(len(b) for b in self._batches)

    def run(self, target: Any) -> None:
        for batch in self._batches:
            target.apply_deltas.remote(batch)  # fire-and-forget, as resumability_client does
        ray.get(target.wait.remote())  # the durable point (see the module docstring)

    def completed(self, target: Any) -> int:
        return sum(ray.get(target.are_completed.remote(self._sids)))


def _pid(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid())))


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


# Both of the actor's anomaly warnings (a new task id, or a changed delta, for a completed source).
_ANOMALY_WARNING = "from the completed set"


def _actors_logger(actor: Any) -> Any:
    """The loguru logger ``actor``'s ``apply_deltas`` logs to (Ray wraps the method: unwrapped)."""
    return inspect.unwrap(type(actor).apply_deltas).__globals__["logger"]


def _count_anomalies(actor: Any) -> int:
    """Count, on ``actor`` (its instance, in its own process), the anomaly warnings logged from now.

    Returns the loguru handler id (remove it when the instance is done with). The logger is the one
    the actor's methods see: in a Ray worker that is not loguru's module-level one, since Ray ships
    the class by value (its module's name holds the ``@ray.remote`` wrapper), with a copy of it.
    """
    logger = _actors_logger(actor)
    actor._bench_anomalies = 0

    def sink(_message: Any) -> None:
        actor._bench_anomalies += 1

    return int(
        logger.add(
            sink, level="WARNING", format="{message}", filter=lambda r: _ANOMALY_WARNING in r["message"]
        )
    )


def _anomalies(actor: Any) -> int:
    return int(ray.get(actor.__ray_call__.remote(lambda self: self._bench_anomalies)))


def _new_actors(count: int, base_dir: str, tag: str) -> list[Any]:
    actors = [ResumabilityActor.remote(base_dir, writer_id=f"bench-{tag}-{i}") for i in range(count)]  # type: ignore[attr-defined]
    ray.get([a.wait.remote() for a in actors])
    ray.get([a.__ray_call__.remote(_count_anomalies) for a in actors])
    return actors


def _drop(actors: list[Any]) -> None:
    ray.get([a.close.remote() for a in actors])
    for a in actors:
        ray.kill(a)


class Anchor:
    def __init__(self) -> None:
        self.writers = [BenchWriter.remote() for _ in range(MAX_WRITERS)]  # type: ignore[attr-defined]
        ray.get([w.__ray_ready__.remote() for w in self.writers])

    def throughput(
        self, mode: str, actors: int, writers: int, sources: int, complete: bool, dir: str, tag: str = "t"
    ) -> dict[str, Any]:
        """One run on the folder ``dir`` by new actors (writer ids ``bench-<tag>-<i>``)."""
        if mode == "inproc":
            return self._in_process(writers, sources, complete, dir, tag)
        targets = _new_actors(actors, dir, tag)
        try:
            pids = [_pid(a) for a in targets]
            mine = self.writers[:writers]
            deltas = sum(ray.get([w.prepare.remote(i, sources, complete) for i, w in enumerate(mine)]))
            cpu0 = sum(_cpu_s(p) for p in pids)
            t0 = time.perf_counter()
            ray.get([w.run.remote(targets[i % actors]) for i, w in enumerate(mine)])
            seconds = time.perf_counter() - t0
            cpu_s = sum(_cpu_s(p) for p in pids) - cpu0
            completed = sum(ray.get([w.completed.remote(targets[i % actors]) for i, w in enumerate(mine)]))
            anomalies = sum(_anomalies(a) for a in targets)
        finally:
            _drop(targets)
        return {
            "seconds": seconds,
            "deltas": deltas,
            "completed": completed,
            "cpu_s": cpu_s,
            "anomalies": anomalies,
        }

    def rerun(self, mode: str, actors: int, writers: int, sources: int, dir: str) -> dict[str, Any]:
        """Every source completed by a first run (not measured), then the same deltas again by new
        actors on the same folder: the second run's figures (see the module docstring)."""
        first = self.throughput(mode, actors, writers, sources, True, dir, tag="first")
        if first["completed"] != writers * sources or first["anomalies"]:
            raise RuntimeError(f"the first run: {first}")
        return self.throughput(mode, actors, writers, sources, True, dir, tag="rerun")

    def _in_process(self, writers: int, sources: int, complete: bool, dir: str, tag: str) -> dict[str, Any]:
        per_writer = [wl.batches(wl.writer_deltas(w, sources, complete=complete)) for w in range(writers)]
        # The writers' batches interleaved, as they would reach one actor.
        order = [b for group in zip(*per_writer, strict=True) for b in group]
        actor = InProcessActor(dir, writer_id=f"bench-inproc-{tag}")
        handler = _count_anomalies(actor)
        try:
            cpu0, t0 = time.process_time(), time.perf_counter()
            for batch in order:
                actor.apply_deltas(batch)
            seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
            sids = [s for w in range(writers) for s in wl.writer_sources(w, sources)]
            completed = sum(actor.are_completed(sids))
        finally:
            actor.close()
            _actors_logger(actor).remove(handler)
        return {
            "seconds": seconds,
            "deltas": sum(len(b) for b in order),
            "completed": completed,
            "cpu_s": cpu_s,
            "anomalies": actor._bench_anomalies,
        }

    def latency(self, samples: int, warmup: int, dir: str) -> dict[str, Any]:
        (actor,) = _new_actors(1, dir, "lat")
        try:
            known = wl.writer_sources(9, 100)
            done = [(f"0_{s}{suffix}", s, d) for s in known[::2] for suffix, d in (("", 1), ("_0", -1))]
            ray.get(actor.apply_deltas.remote(done))
            asked, applied = [], []
            for i in range(warmup + samples):
                t0 = time.perf_counter()
                ray.get(actor.are_completed.remote([known[i % len(known)]]))
                t1 = time.perf_counter()
                actor.apply_deltas.remote([(f"lat-{i}", f"lat-src-{i}", 1)])
                ray.get(actor.wait.remote())
                t2 = time.perf_counter()
                if i >= warmup:
                    asked.append((t1 - t0) * 1000)
                    applied.append((t2 - t1) * 1000)
        finally:
            _drop([actor])
        return {"are_completed_ms": asked, "apply_flush_ms": applied}

    def load(self, dir: str, empty_dir: str, count: int, queries: int) -> dict[str, Any]:
        # An actor with nothing to load: the baseline its memory per id is measured from.
        (empty,) = _new_actors(1, empty_dir, "empty")
        rss_empty = _status_kb(_pid(empty), "VmRSS") * 1024
        _drop([empty])
        # Opening alone, without starting a Ray worker: the actor's constructor reads every file.
        t0 = time.perf_counter()
        InProcessActor(dir, writer_id="bench-anchor").close()
        opening = time.perf_counter() - t0
        gc.collect()
        t0 = time.perf_counter()
        actor = ResumabilityActor.remote(dir, writer_id="bench-anchor")  # type: ignore[attr-defined]
        try:
            ray.get(actor.wait.remote())  # what create_resumability_actor waits for
            ready = time.perf_counter() - t0
            first = ray.get(actor.are_completed.remote(wl.query_ids(count, 2)))
            first_answer = time.perf_counter() - t0
            assert first == [True, False], first
            pid = _pid(actor)
            rss = _status_kb(pid, "VmRSS") * 1024
            peak = _status_kb(pid, "VmHWM") * 1024
            asked = wl.query_ids(count, queries)
            chunks = [asked[i : i + wl.QUERY_CHUNK] for i in range(0, len(asked), wl.QUERY_CHUNK)]
            hits = 0
            t1 = time.perf_counter()
            for chunk in chunks:
                hits += sum(ray.get(actor.are_completed.remote(chunk)))
            seconds = time.perf_counter() - t1
        finally:
            _drop([actor])
        return {
            "ready_s": ready,
            "open_s": opening,
            "first_answer_s": first_answer,
            "rss": rss,
            "rss_empty": rss_empty,
            "peak": peak,
            "ids_per_s": len(asked) / seconds,
            "hits": hits,
        }

    def daemons(self) -> dict[str, Any]:
        """Resident memory of this Ray instance's own processes (not its workers, not this driver)."""
        marker = f"TALLY_BENCH_RAY={os.environ.get('TALLY_BENCH_RAY', '')}".encode()
        rss = count = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                if (entry / "cmdline").read_bytes().startswith(b"ray::"):
                    continue  # a worker or actor
                rss += _status_kb(int(entry.name), "VmRSS") * 1024
                count += 1
            except (OSError, ValueError):
                continue
        return {"rss": rss, "processes": count}


def _answer(payload: dict[str, Any]) -> None:
    _ANSWERS.write(json.dumps(payload) + "\n")


def main() -> None:
    temp_dir = sys.argv[1]
    t0 = time.perf_counter()
    ray.init(
        num_cpus=os.cpu_count() or 2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 << 20,
        _temp_dir=temp_dir,
    )
    try:
        anchor = Anchor()
        from importlib.metadata import version

        _answer(
            {
                "ray": ray.__version__,
                "nemo_curator": version("nemo-curator"),
                "python": sys.version.split()[0],
                "start_s": time.perf_counter() - t0,
            }
        )
        for line in sys.stdin:
            request = json.loads(line)
            cmd = request.pop("cmd")
            if cmd == "quit":
                break
            try:
                _answer(getattr(anchor, cmd)(**request))
            except Exception:  # noqa: BLE001 - the caller shows it and stops
                _answer({"error": traceback.format_exc()})
    finally:
        ray.shutdown()
        _answer({"bye": True})


if __name__ == "__main__":
    main()
