"""The NeMo Curator drop-in without Ray: the proxy over a fake transport, the context manager over a
fake ``ray`` module that keeps NeMo Curator's named-actor semantics. The real thing runs in
``tests/nemo/``."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tally import AlreadyExists, Internal
from tally.integrations import nemo_curator
from tally.integrations.nemo_curator import (
    ACTOR_NAME,
    ACTOR_NAMESPACE,
    TallyResumabilityProxy,
    tally_for_nemo_curator,
)
from tests.unit.client.tally_fakes import FakeTransport, make_client, no_tally_threads

ADDRESS = "grpc://coordinator:50051"


@pytest.fixture
def fake() -> FakeTransport:
    return FakeTransport()


@pytest.fixture
def clients(monkeypatch: pytest.MonkeyPatch, fake: FakeTransport) -> Iterator[list[tuple[Any, ...]]]:
    """Every proxy gets a client over ``fake``; yields the (address, token, timeout) it was given."""
    made: list[tuple[Any, ...]] = []

    def factory(address: str, *, token: str | None = None, timeout: float | None = None) -> Any:
        made.append((address, token, timeout))
        return make_client(fake)

    monkeypatch.setattr(nemo_curator, "Client", factory)
    yield made
    assert no_tally_threads(), "a proxy left its writer's threads running"


# ---------------------------------------------------------------------------- the proxy


def test_proxy_opens_a_writer_and_forwards(fake: FakeTransport, clients: list[tuple[Any, ...]]) -> None:
    fake.completed = {"a.jsonl", "b.jsonl"}
    proxy = TallyResumabilityProxy(
        ADDRESS, "curation/run-42", writer_id="w1", labels={"job": "7"}, token="t", timeout=5.0
    )
    assert clients == [(ADDRESS, "t", 5.0)]
    assert [(s.checkpoint, s.writer_id, dict(s.labels)) for s in fake.specs] == [
        ("curation/run-42", "w1", {"job": "7"})
    ]
    assert proxy.wait() == 2
    assert proxy.are_completed(["a.jsonl", "c.jsonl"]) == [True, False]
    deltas = [("0_a", "c.jsonl", 1), ("0_a_0", "c.jsonl", -1)]
    assert proxy.apply_deltas(deltas) is None
    proxy.close()
    # close() delivered everything before closing the writer.
    assert fake.applied == deltas
    assert fake.count("close_writer") == 1
    proxy.close()  # idempotent: NeMo Curator may call it again on a left-over actor
    assert fake.count("close_writer") == 1


def test_the_source_stage_skips_failed_sources_too(
    fake: FakeTransport, clients: list[tuple[Any, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    fake.completed = {"a"}
    fake.max_attempts = 2
    fake.failed_attempts = {"b": ["oom", "oom"], "c": ["oom"]}  # c is under the budget
    proxy = TallyResumabilityProxy(ADDRESS, "cp")
    with caplog.at_level("WARNING", logger=nemo_curator.__name__):
        assert proxy.are_completed(["a", "b", "c", "d"]) == [True, True, False, False]
    # One call, for the ids not completed, failed ones only.
    assert fake.args["list_failures"] == [("cp", ("b", "c", "d"), True, "")]
    assert "skipping 1 failed source (it used up" in caplog.text and "tally retry cp" in caplog.text
    proxy.close()
    assert fake.applied == []  # nothing about failures reaches the completions


def test_failures_reported_through_the_actor_make_a_source_skipped(
    fake: FakeTransport, clients: list[tuple[Any, ...]]
) -> None:
    proxy = TallyResumabilityProxy(ADDRESS, "cp", max_attempts=1)
    fake.max_attempts = 1  # what the budget call set on a real coordinator
    report = proxy.report_failure("b", "bad row")
    assert (report.attempts, report.failed) == (1, True)
    assert proxy.are_completed(["a", "b"]) == [False, True]
    proxy.close()


def test_no_failures_call_when_every_source_is_completed(
    fake: FakeTransport, clients: list[tuple[Any, ...]]
) -> None:
    fake.completed = {"a", "b"}
    proxy = TallyResumabilityProxy(ADDRESS, "cp")
    assert proxy.are_completed(["a", "b"]) == [True, True]
    assert proxy.are_completed([]) == []
    assert fake.count("list_failures") == 0
    proxy.close()


def test_an_unanswered_failures_call_skips_no_source_as_failed(
    fake: FakeTransport, clients: list[tuple[Any, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    fake.max_attempts = 1
    fake.failed_attempts = {"b": ["x"]}
    fake.fail("list_failures", Internal("an older coordinator"))
    proxy = TallyResumabilityProxy(ADDRESS, "cp")
    with caplog.at_level("WARNING", logger=nemo_curator.__name__):
        assert proxy.are_completed(["a", "b"]) == [False, False]
    assert "none skipped as failed" in caplog.text
    assert proxy.are_completed(["a", "b"]) == [False, True]  # answered again: skipped
    proxy.close()


def test_the_source_stage_partitions_are_declared(
    fake: FakeTransport, clients: list[tuple[Any, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    fake.completed = {"a"}
    proxy = TallyResumabilityProxy(ADDRESS, "cp")
    assert proxy.are_completed(["a", "b", "c"]) == [True, False, False]
    # One declaration, before the question; done sources are declared too (the total is all of them).
    assert fake.args["declare_sources"] == [("cp", ("a", "b", "c"), 0)]
    assert fake.calls.index("declare_sources") < fake.calls.index("are_completed")
    assert proxy.are_completed([]) == [] and fake.count("declare_sources") == 1
    proxy.close()


def test_a_refused_declaration_is_logged_once_and_the_run_goes_on(
    fake: FakeTransport, clients: list[tuple[Any, ...]], caplog: pytest.LogCaptureFixture
) -> None:
    fake.fail("declare_sources", Internal("an older coordinator"))
    proxy = TallyResumabilityProxy(ADDRESS, "cp")
    with caplog.at_level("WARNING", logger=nemo_curator.__name__):
        assert proxy.are_completed(["a", "b"]) == [False, False]
        assert proxy.are_completed(["c"]) == [False]
    assert caplog.text.count("could not declare") == 1
    assert fake.count("declare_sources") == 1
    proxy.close()


def test_the_proxy_sets_the_failure_budget_as_it_opens(
    fake: FakeTransport, clients: list[tuple[Any, ...]]
) -> None:
    proxy = TallyResumabilityProxy(ADDRESS, "cp", max_attempts=3)
    assert fake.args["set_failure_budget"] == [("cp", 3)]
    assert fake.calls[:2] == ["set_failure_budget", "open_writer"]
    proxy.close()


def test_apply_deltas_never_raises(fake: FakeTransport, clients: list[tuple[Any, ...]]) -> None:
    proxy = TallyResumabilityProxy(ADDRESS, "cp")
    proxy.apply_deltas([("t", "s", "not an int")])  # type: ignore[list-item]
    proxy.apply_deltas(None)  # type: ignore[arg-type]
    with pytest.raises(Exception):  # noqa: B017 - the refusal surfaces at close, not in apply_deltas
        proxy.close()
    proxy.apply_deltas([("t", "s", 1)])  # after close: dropped, still no exception


def test_failed_open_raises_and_leaves_nothing_running(
    fake: FakeTransport, clients: list[tuple[Any, ...]]
) -> None:
    fake.fail("open_writer", AlreadyExists("writer w1 is live"))
    with pytest.raises(AlreadyExists):
        TallyResumabilityProxy(ADDRESS, "cp")


# ---------------------------------------------------------------------------- a fake ray


class _Handle:
    def __init__(self, ray: FakeRay, obj: Any) -> None:
        self._ray, self._obj, self.alive = ray, obj, True

    def __getattr__(self, method: str) -> Any:
        handle = self

        class _Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Callable[[], Any]:
                # An object ref is a thunk that ray.get runs, so errors surface at ray.get.
                def call() -> Any:
                    if not handle.alive:
                        raise RuntimeError("actor is dead")
                    return getattr(handle._obj, method)(*args, **kwargs)

                return call

        return _Method


class FakeRay:
    """Just enough of ``ray`` for the context manager: named detached actors in namespaces."""

    def __init__(self, initialized: bool = False) -> None:
        self.initialized = initialized
        self.actors: dict[tuple[str, str], _Handle] = {}
        self.log: list[str] = []
        self.options_seen: list[dict[str, Any]] = []

    def is_initialized(self) -> bool:
        return self.initialized

    def get_runtime_context(self) -> Any:
        assert self.initialized
        return types.SimpleNamespace(gcs_address="10.0.0.1:6379")

    def init(self, address: str | None = None, **kwargs: Any) -> None:
        assert not self.initialized
        self.initialized = True
        self.log.append(f"init {address}")

    def shutdown(self) -> None:
        self.initialized = False
        self.log.append("shutdown")

    def remote(self, **actor_options: Any) -> Callable[[type], Any]:
        ray = self

        def wrap(cls: type) -> Any:
            class _ActorClass:
                @staticmethod
                def options(**options: Any) -> Any:
                    ray.options_seen.append({**actor_options, **options})
                    key = (options["name"], options["namespace"])

                    class _Creator:
                        @staticmethod
                        def remote(*args: Any, **kwargs: Any) -> _Handle:
                            assert ray.initialized
                            if key in ray.actors and not options.get("get_if_exists"):
                                raise ValueError(f"actor {key} already exists")
                            handle = _Handle(ray, cls(*args, **kwargs))
                            ray.actors[key] = handle
                            ray.log.append("create")
                            return handle

                    return _Creator

            return _ActorClass

        return wrap

    def get_actor(self, name: str, namespace: str | None = None) -> _Handle:
        assert self.initialized
        try:
            return self.actors[(name, namespace or "")]
        except KeyError:
            raise ValueError(f"Failed to look up actor {name!r}") from None

    def get(self, ref: Callable[[], Any], timeout: float | None = None) -> Any:
        assert self.initialized
        return ref()

    def kill(self, handle: _Handle) -> None:
        handle.alive = False
        self.actors = {k: h for k, h in self.actors.items() if h is not handle}
        self.log.append("kill")

    def nemo_run(self) -> list[bool]:
        """What Pipeline.run does with the actor: adopt, use, close, kill."""
        self.init("auto")
        actor = self.get_actor(ACTOR_NAME, ACTOR_NAMESPACE)
        self.get(actor.wait.remote())
        done = self.get(actor.are_completed.remote(["a", "b"]))
        actor.apply_deltas.remote([("0_b", "b", 1)])()
        self.get(actor.close.remote(), timeout=30)
        self.kill(actor)
        self.shutdown()
        return list(done)


class FakeStateApi:
    """``ray.util.state`` of a head whose API server answers at most ``max_limit`` entries, as
    Ray 2.60's does (``RAY_MAX_LIMIT_FROM_API_SERVER``, default 10000)."""

    def __init__(self, max_limit: int = 40000) -> None:
        self.max_limit = max_limit
        self.calls: list[dict[str, Any]] = []
        self.error: Exception | None = None

    def list_actors(self, **kwargs: Any) -> list[dict[str, Any]]:
        self.calls.append(kwargs)
        if self.error is not None:
            raise self.error
        if kwargs["limit"] > self.max_limit:
            raise RuntimeError(  # Ray raises RayStateApiException, whose text this is
                "API server internal error. See dashboard.log file for more details. Error: Given limit "
                f"{kwargs['limit']} exceeds the supported limit {self.max_limit}. Use a lower limit, or set "
                "the `RAY_MAX_LIMIT_FROM_API_SERVER` environment variable to a larger value."
            )
        return []


@pytest.fixture
def state_api(monkeypatch: pytest.MonkeyPatch) -> FakeStateApi:
    state = FakeStateApi()
    monkeypatch.setitem(sys.modules, "ray.util.state", state)
    return state


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch, state_api: FakeStateApi) -> FakeRay:
    ray = FakeRay()
    monkeypatch.setitem(sys.modules, "ray", ray)
    return ray


class _Stale:
    closed = False

    def close(self) -> None:
        _Stale.closed = True


def test_context_manager_creates_the_named_detached_actor(
    fake: FakeTransport, clients: list[tuple[Any, ...]], fake_ray: FakeRay
) -> None:
    fake.completed = {"a"}
    with tally_for_nemo_curator("curation/run-42", ADDRESS, writer_id="w1", labels={"k": "v"}):
        # Ray is disconnected again: Pipeline.run makes its own ray.init().
        assert not fake_ray.initialized
        assert fake_ray.nemo_run() == [True, False]
    opts = fake_ray.options_seen[-1]
    assert opts["name"] == ACTOR_NAME == "nemo_curator_resumability"
    assert opts["namespace"] == ACTOR_NAMESPACE == ACTOR_NAME
    assert opts["lifetime"] == "detached" and opts["get_if_exists"] is False
    assert opts["num_cpus"] == 0
    assert [s.writer_id for s in fake.specs] == ["w1"]
    assert fake.applied == [("0_b", "b", 1)]
    assert fake.count("close_writer") == 1
    # NeMo removed the actor, so nothing is left to clean up.
    assert fake_ray.log == [
        *("init auto", "create", "shutdown"),  # the context manager
        *("init auto", "kill", "shutdown"),  # Pipeline.run
        *("init auto", "shutdown"),  # the context manager, nothing left to remove
    ]
    assert fake_ray.actors == {}


def test_coordinator_settings_come_from_the_driver_environment(
    fake: FakeTransport,
    clients: list[tuple[Any, ...]],
    fake_ray: FakeRay,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The actor runs with the Ray worker's environment, so TALLY_* are read where the block runs.
    monkeypatch.setenv("TALLY_ADDRESS", "grpc://from-env:1")
    monkeypatch.setenv("TALLY_TOKEN", "secret")
    monkeypatch.setenv("TALLY_TIMEOUT", "7")
    with tally_for_nemo_curator("cp"):
        pass
    with tally_for_nemo_curator("cp", ADDRESS, token="t", timeout=3.0):
        pass
    assert clients == [("grpc://from-env:1", "secret", 7.0), (ADDRESS, "t", 3.0)]


def test_a_left_over_actor_is_closed_and_replaced(
    fake: FakeTransport, clients: list[tuple[Any, ...]], fake_ray: FakeRay
) -> None:
    _Stale.closed = False
    stale = _Handle(fake_ray, _Stale())
    fake_ray.actors[(ACTOR_NAME, ACTOR_NAMESPACE)] = stale
    with tally_for_nemo_curator("cp", ADDRESS):
        assert not stale.alive and _Stale.closed
        assert isinstance(fake_ray.actors[(ACTOR_NAME, ACTOR_NAMESPACE)]._obj, TallyResumabilityProxy)
        fake_ray.nemo_run()


def test_actor_left_by_a_failed_run_is_removed(
    fake: FakeTransport, clients: list[tuple[Any, ...]], fake_ray: FakeRay
) -> None:
    with pytest.raises(RuntimeError, match="pipeline failed"):
        with tally_for_nemo_curator("cp", ADDRESS):
            fake_ray.init("auto")
            fake_ray.get(fake_ray.get_actor(ACTOR_NAME, ACTOR_NAMESPACE).apply_deltas.remote([("t", "s", 1)]))
            fake_ray.shutdown()
            raise RuntimeError("pipeline failed")
    assert fake_ray.actors == {}
    assert fake.applied == [("t", "s", 1)]  # closed (delivered) before it was killed
    assert fake.count("close_writer") == 1


def test_an_existing_ray_connection_is_used_and_kept(
    fake: FakeTransport,
    clients: list[tuple[Any, ...]],
    monkeypatch: pytest.MonkeyPatch,
    state_api: FakeStateApi,
) -> None:
    ray = FakeRay(initialized=True)
    monkeypatch.setitem(sys.modules, "ray", ray)
    with tally_for_nemo_curator("cp", ADDRESS):
        assert ray.initialized
    assert ray.initialized and "shutdown" not in ray.log and not any(e.startswith("init") for e in ray.log)
    assert ray.actors == {}  # no run happened: the context manager removed its own actor


def test_failed_writer_open_surfaces_before_the_run(
    fake: FakeTransport, clients: list[tuple[Any, ...]], fake_ray: FakeRay
) -> None:
    fake.fail("open_writer", AlreadyExists("writer w1 is live"))
    with pytest.raises(AlreadyExists):
        with tally_for_nemo_curator("cp", ADDRESS):
            pytest.fail("the block must not run")
    assert fake_ray.actors == {} and not fake_ray.initialized


def test_missing_ray_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(ImportError, match="needs Ray.*pip install nemo-curator"):
        with tally_for_nemo_curator("cp", ADDRESS):
            pytest.fail("the block must not run")


def test_importing_the_integration_does_not_import_ray() -> None:
    code = "import json, sys, tally.integrations.nemo_curator; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert not [m for m in json.loads(out) if m.split(".")[0] in ("ray", "nemo_curator", "grpc")]


# ---------------------------------------------------------------------------- the Ray head's state API limit


def test_the_ray_heads_state_api_limit_is_checked_before_anything_starts(
    fake: FakeTransport, clients: list[tuple[Any, ...]], fake_ray: FakeRay, state_api: FakeStateApi
) -> None:
    state_api.max_limit = 10000  # a head started without RAY_MAX_LIMIT_FROM_API_SERVER
    with pytest.raises(RuntimeError) as refused:
        with tally_for_nemo_curator("cp", ADDRESS):
            pytest.fail("the block must not run")
    assert str(refused.value) == (
        "the Ray head's API server answers state queries of at most 10000 entries and NeMo Curator's "
        "XennaExecutor asks for 40000: restart the Ray head with RAY_MAX_LIMIT_FROM_API_SERVER=40000 in "
        "its environment (e.g. `RAY_MAX_LIMIT_FROM_API_SERVER=40000 ray start --head ...`; NeMo "
        "Curator's RayClient sets it), or pass check_ray_limit=False with another executor"
    )
    # Asked the connected cluster, as Xenna asks it; no actor, no writer, Ray disconnected again.
    (call,) = state_api.calls
    assert call["limit"] == 40000 and call["address"] == "10.0.0.1:6379"
    assert fake_ray.actors == {} and not fake_ray.initialized and clients == []

    state_api.max_limit = 40000  # restarted with the variable
    with tally_for_nemo_curator("cp", ADDRESS):
        fake_ray.nemo_run()
    assert len(state_api.calls) == 2 and fake.count("close_writer") == 1


def test_the_check_can_be_skipped_and_lets_an_unanswered_query_through(
    fake: FakeTransport,
    clients: list[tuple[Any, ...]],
    fake_ray: FakeRay,
    state_api: FakeStateApi,
    caplog: pytest.LogCaptureFixture,
) -> None:
    state_api.max_limit = 10000
    with tally_for_nemo_curator("cp", ADDRESS, check_ray_limit=False):  # e.g. RayDataExecutor
        fake_ray.nemo_run()
    assert state_api.calls == []
    # A head without a dashboard cannot be asked: a warning, and the run goes on.
    state_api.error = ConnectionError("Failed to connect to API server. Please check the API server log")
    with caplog.at_level("WARNING", logger=nemo_curator.__name__), tally_for_nemo_curator("cp", ADDRESS):
        fake_ray.nemo_run()
    assert [r.getMessage() for r in caplog.records] == [
        "could not check the Ray cluster's RAY_MAX_LIMIT_FROM_API_SERVER (NeMo Curator's XennaExecutor "
        "needs 40000): Failed to connect to API server. Please check the API server log"
    ]
    assert fake.count("close_writer") == 2


# ---------------------------------------------------------------------------- shard labels


def test_the_writer_is_labelled_with_the_drivers_slurm_and_nemo_curator_shard(
    fake: FakeTransport, clients: list[tuple[Any, ...]], fake_ray: FakeRay, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The driver's environment: the actor (here in this process too) is given them as labels.
    monkeypatch.setenv("NEMO_CURATOR_SLURM_ARRAY_SHARD_INDEX", "3")
    monkeypatch.setenv("NEMO_CURATOR_SLURM_ARRAY_TOTAL_SHARDS", "8")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with tally_for_nemo_curator("cp", ADDRESS, labels={"team": "x", "slurm_job_id": "mine"}):
        fake_ray.nemo_run()
    assert [dict(s.labels) for s in fake.specs] == [
        {
            "nemo_curator_shard_index": "3",
            "nemo_curator_total_shards": "8",
            "slurm_job_id": "mine",
            "team": "x",
        }
    ]
