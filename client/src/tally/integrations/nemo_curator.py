"""NeMo Curator drop-in: run ``Pipeline.run(checkpoint_path=...)`` with Tally as its checkpoint.

NeMo Curator 1.4.0 keeps its resumability state in one detached Ray actor, created with
``get_if_exists=True`` under a fixed name and namespace. An actor that already exists under that
name is adopted as is, so creating :class:`TallyResumabilityProxy` there first makes every worker
of the pipeline talk to a Tally writer instead of NeMo Curator's LMDB files::

    from tally.integrations.nemo_curator import tally_for_nemo_curator

    with tally_for_nemo_curator(checkpoint="curation/run-42", address="grpc://coordinator:50051"):
        pipeline.run(executor, checkpoint_path="/unused/when/tally/is/active")

The source stage's partitions are declared to the checkpoint as it asks which to skip (see
:meth:`TallyResumabilityProxy.are_completed`), so ``tally status``, ``tally watch`` and the dashboard
show a total, a percent and an ETA, and ``tally remaining`` lists what is left.

Sources that are *failed* (reported failed ``max_attempts`` times, see
:meth:`tally.Writer.report_failure`) are skipped by the source stage too, until ``tally retry``
clears them; the NeMo-format files never hear of failures.

With ``claims=True`` the source stage also claims the partitions it will run
(:meth:`tally.Writer.acquire`) and skips those another live writer holds: two pipelines started on
one checkpoint at the same time (two SLURM jobs, a resubmission while the first still runs) split
the partitions instead of both processing them. A claim lasts until its partition completes or
the run ends (its writer closes or loses its lease); the next run takes what is left.

The proxy keeps no state of its own: NeMo Curator writes no completion file to ``checkpoint_path``
when it adopts the actor (only its SLURM-array markers, in that mode), and closes and kills the
actor at the end of every run, so each run is a new Tally writer whose completions are durable on
the coordinator before the actor dies.

Ray and NeMo Curator are optional: this module imports ray only inside the functions that need it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from tally._client import Client
from tally._config import ClientConfig
from tally._labels import environment_labels
from tally._trace import TRACE_ENV
from tally._types import FailureReport
from tally._words import count
from tally.errors import TallyError

logger = logging.getLogger(__name__)

# NeMo Curator 1.4.0: nemo_curator.utils.resumability_client.ACTOR_NAME, used as name and namespace.
ACTOR_NAME = "nemo_curator_resumability"
ACTOR_NAMESPACE = ACTOR_NAME

# What NeMo Curator's XennaExecutor (cosmos_xenna 0.2) passes as `limit` to Ray's state API
# (ray.util.state.list_actors); the Ray head's API server refuses more than its
# RAY_MAX_LIMIT_FROM_API_SERVER (default 10000), read from the head's environment when it starts.
XENNA_STATE_API_LIMIT = 40000
LIMIT_VARIABLE = "RAY_MAX_LIMIT_FROM_API_SERVER"
# Ray 2.x's answer (ray.dashboard.state_api_utils.options_from_req) to a limit above it.
_REFUSED_LIMIT = re.compile(r"exceeds the supported limit (\d+)")
# An empty trace path means "no trace, whatever TALLY_TRACE says" to Client.writer.
_NO_TRACE = ""

# NeMo Curator gives close() 30 s (ray.get timeout) before it kills the actor; finish before that.
_CLOSE_TIMEOUT_S = 25.0


class TallyResumabilityProxy:
    """The body of the Ray actor that stands in for NeMo Curator's ``ResumabilityActor``.

    It opens a Tally writer of ``checkpoint`` when created and forwards NeMo Curator's four calls
    to it. Usable without Ray (that is how it is unit-tested); :func:`tally_for_nemo_curator`
    wraps it with ``ray.remote``.
    """

    def __init__(
        self,
        address: str,
        checkpoint: str,
        *,
        writer_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        token: str | None = None,
        timeout: float | None = None,
        max_attempts: int | None = None,
        claims: bool = False,
        trace: str | None = None,
    ) -> None:
        """Connect to the coordinator and open a writer of ``checkpoint``.

        Args:
            address: Coordinator address, e.g. ``grpc://coordinator:50051``.
            checkpoint: Checkpoint name, e.g. ``curation/run-42``.
            writer_id: Defaults to ``<hostname>-<pid>`` of the actor process, new every run.
            labels: Free-form labels shown in status views.
            token: Bearer token, when the coordinator requires one.
            timeout: Seconds a coordinator call may take; the client's default when None.
            max_attempts: Set the checkpoint's failure budget as the writer opens; None leaves it.
            claims: Claim the partitions the source stage runs; skip those another live writer holds.
            trace: Record NeMo Curator's calls and the coordinator's answers to this JSONL file on
                the actor's machine (see :meth:`tally.Client.writer`); None: no trace (the actor
                does not read ``TALLY_TRACE``: :func:`tally_for_nemo_curator` passes it on).

        Raises:
            tally.TallyError: The writer could not be opened (e.g. ``Unavailable``), or the trace
                file could not be opened (``InvalidArgument``).
        """
        self._client = Client(address, token=token, timeout=timeout)
        self._checkpoint = checkpoint
        self._claims = claims
        # False after a refused declaration (e.g. a coordinator older than declared totals).
        self._declaring = True
        try:
            # trace="" rather than None: the actor's TALLY_TRACE is not this run's choice.
            self._writer = self._client.writer(
                checkpoint,
                writer_id=writer_id,
                labels=labels,
                max_attempts=max_attempts,
                trace=trace if trace else _NO_TRACE,
            )
            self._writer.open()
        except BaseException:
            self._client.close()
            raise
        logger.info(
            "tally writer %s open on checkpoint %r (%s already completed)",
            self._writer.writer_id,
            checkpoint,
            count(self._writer.completed_at_open or 0, "source"),
        )

    def wait(self) -> int:
        """Return once the writer is open (NeMo Curator calls this right after creating the actor).

        Returns:
            How many sources the checkpoint had completed when this writer opened.
        """
        completed = self._writer.completed_at_open or 0
        self._writer._trace_row("wait", result=completed)
        return completed

    def are_completed(self, source_ids: list[str]) -> list[bool]:
        """Which of ``source_ids`` the source stage skips: those the checkpoint has completed (live,
        across all writers), and those that are failed (reached the checkpoint's ``max_attempts``).

        NeMo Curator asks only to skip sources (its source stage is the one caller, with every
        partition it made), so the ids are first declared as the checkpoint's sources
        (:meth:`tally.Client.declare`: idempotent and additive, so each SLURM array task or batch
        adds its share); a declaration that fails is logged and the run goes on without a total.
        A failed source answers True here without being completed anywhere. The failed ones are found with
        one more call, for the ids not completed, and logged; if that call fails, no source is
        skipped as failed (a warning says why) and the run goes on.

        Args:
            source_ids: Source ids, as NeMo Curator's reader stage names them.

        Returns:
            One bool per id, in order.
        """
        self._declare(source_ids)
        if self._claims:
            skipped = self._claim(source_ids)
            if skipped is not None:
                return skipped
        done = self._writer.are_completed(source_ids)
        left = [sid for sid, completed in zip(source_ids, done, strict=True) if not completed]
        if not left:
            return done
        try:
            failed = {
                f.source_id
                for f in self._client.failures(self._checkpoint, source_ids=left, failed_only=True)
            }
        except TallyError as err:
            logger.warning(
                "tally checkpoint %r: could not ask which sources are failed (none skipped as failed): %s",
                self._checkpoint,
                err,
            )
            return done
        if not failed:
            return done
        logger.warning(
            "tally checkpoint %r: skipping %s (%s the checkpoint's failure budget; list %s with "
            "`tally failed %s`, run %s again after `tally retry %s`)",
            self._checkpoint,
            count(len(failed), "failed source"),
            "it used up" if len(failed) == 1 else "they used up",
            "it" if len(failed) == 1 else "them",
            self._checkpoint,
            "it" if len(failed) == 1 else "them",
            self._checkpoint,
        )
        return [completed or sid in failed for sid, completed in zip(source_ids, done, strict=True)]

    def _claim(self, source_ids: list[str]) -> list[bool] | None:
        """Claim the partitions for this run: skip all but those acquired. None if the call failed."""
        try:
            claims = self._writer.acquire(source_ids)
        except TallyError as err:
            logger.warning(
                "tally checkpoint %r: could not claim the source stage's partitions (skipping only "
                "completed and failed ones; another run may process the same partitions): %s",
                self._checkpoint,
                err,
            )
            return None
        states = [claims[sid].state for sid in source_ids]
        held = states.count("held")
        failed = states.count("failed")
        if held or failed:
            logger.warning(
                "tally checkpoint %r: skipping %s other live writers hold and %d failed "
                "(`tally failed %s` lists those); %d claimed for this run",
                self._checkpoint,
                count(held, "partition"),
                failed,
                self._checkpoint,
                states.count("acquired"),
            )
        return [state != "acquired" for state in states]

    def _declare(self, source_ids: list[str]) -> None:
        if not self._declaring or not source_ids:
            return
        try:
            total = self._client.declare(self._checkpoint, source_ids)
        except TallyError as err:
            self._declaring = False
            logger.warning(
                "tally checkpoint %r: could not declare the source stage's %s (no total, "
                "percent or ETA in status views): %s",
                self._checkpoint,
                count(len(source_ids), "partition"),
                err,
            )
            return
        logger.info("tally checkpoint %r: %s declared", self._checkpoint, count(total, "source"))

    def report_failure(self, source_id: str, reason: str = "") -> FailureReport:
        """Count a failed attempt at a source for the checkpoint's failure budget (durable on return).

        Not one of NeMo Curator's calls: a stage or the driver may call it on the actor
        (``ray.get(ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE).report_failure.remote(
        source_id, reason))``). See :meth:`tally.Writer.report_failure`.
        """
        return self._writer.report_failure(source_id, reason)

    def apply_deltas(self, per_task: list[tuple[str, str, int]]) -> None:
        """Queue ``(task_id, source_id, delta)`` tuples for the coordinator. Never raises.

        Args:
            per_task: Deltas in the order the worker reported them.
        """
        try:
            self._writer.apply_deltas(per_task)
        except Exception:  # Writer.apply_deltas never raises; a Ray actor call must not either.
            logger.exception("tally writer %s: apply_deltas failed", self._writer.writer_id)

    def close(self) -> None:
        """Deliver buffered deltas and close the writer, so its completions are durable.

        Idempotent. NeMo Curator calls it at the end of every run, then kills the actor.

        Raises:
            tally.TallyError: The buffer could not be delivered or the writer not closed; NeMo
                Curator logs this as a warning.
        """
        try:
            result = self._writer.close(timeout=_CLOSE_TIMEOUT_S)
        finally:
            self._client.close()
        logger.info("tally writer %s closed: %s", self._writer.writer_id, result)


def _import_ray() -> Any:
    try:
        import ray  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise ImportError(
            "tally.integrations.nemo_curator needs Ray, which NeMo Curator installs: "
            "pip install nemo-curator (or pip install ray)"
        ) from exc
    return ray


def _existing_actor(ray: Any) -> Any:
    try:
        return ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
    except ValueError:  # what Ray raises for "no actor with this name"
        return None


def _close_and_kill(ray: Any, actor: Any, why: str) -> None:
    try:
        ray.get(actor.close.remote(), timeout=_CLOSE_TIMEOUT_S + 5)
    except Exception as exc:
        logger.warning("%s: close() of the resumability actor failed: %s", why, exc)
    with contextlib.suppress(Exception):  # already dead is fine
        ray.kill(actor)


def check_state_api_limit(ray: Any) -> None:
    """Refuse a Ray cluster whose API server would refuse NeMo Curator's XennaExecutor.

    Asks the connected cluster's state API for the one actor named :data:`ACTOR_NAME` with
    ``limit=40000``, as Xenna's monitoring does for every alive actor: the head answers that
    ``Given limit 40000 exceeds the supported limit 10000`` unless its API server (the dashboard
    process) was started with ``RAY_MAX_LIMIT_FROM_API_SERVER=40000`` in its environment. The
    driver's own environment says nothing about that: importing ``nemo_curator`` sets the variable
    in the driver, but the head read its value when it started. A cluster the check cannot ask
    (no dashboard, no answer in 10 s) is let through with a warning.

    Raises:
        RuntimeError: The head refuses the limit; the message says which variable to set where.
    """
    state = importlib.import_module("ray.util.state")
    try:
        state.list_actors(
            address=ray.get_runtime_context().gcs_address,
            filters=[("name", "=", ACTOR_NAME)],
            limit=XENNA_STATE_API_LIMIT,
            timeout=10,
            raise_on_missing_output=False,
        )
    except Exception as exc:
        refused = _REFUSED_LIMIT.search(str(exc))
        if refused:
            raise RuntimeError(
                f"the Ray head's API server answers state queries of at most {refused.group(1)} entries "
                f"and NeMo Curator's XennaExecutor asks for {XENNA_STATE_API_LIMIT}: restart the Ray head "
                f"with {LIMIT_VARIABLE}={XENNA_STATE_API_LIMIT} in its environment (e.g. "
                f"`{LIMIT_VARIABLE}={XENNA_STATE_API_LIMIT} ray start --head ...`; NeMo Curator's RayClient "
                f"sets it), or pass check_ray_limit=False with another executor"
            ) from None
        logger.warning(
            "could not check the Ray cluster's %s (NeMo Curator's XennaExecutor needs %d): %s",
            LIMIT_VARIABLE,
            XENNA_STATE_API_LIMIT,
            str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
        )


@contextlib.contextmanager
def _ray_connection(ray: Any, ray_address: str | None) -> Iterator[None]:
    # NeMo Curator's Pipeline.run makes its own ray.init()/shutdown, so the context manager holds
    # a connection only while it creates or removes the actor (which is detached and outlives it),
    # and leaves a connection the caller made alone.
    if ray.is_initialized():
        yield
        return
    ray.init(address=ray_address or "auto", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def tally_for_nemo_curator(
    checkpoint: str,
    address: str | None = None,
    *,
    writer_id: str | None = None,
    labels: Mapping[str, str] | None = None,
    token: str | None = None,
    timeout: float | None = None,
    ray_address: str | None = None,
    max_attempts: int | None = None,
    claims: bool = False,
    check_ray_limit: bool = True,
    trace: str | None = None,
) -> Iterator[None]:
    """Make the NeMo Curator run inside the block record its progress in a Tally checkpoint.

    Before the block, it creates NeMo Curator's resumability actor (detached, under NeMo Curator's
    name and namespace) as a proxy to a new Tally writer of ``checkpoint``, and waits until the
    writer is open. ``Pipeline.run(checkpoint_path=...)`` then adopts it: sources the checkpoint
    has completed are skipped, and completions go to the coordinator. Its ``checkpoint_path`` must
    still be set (it switches resumability on); NeMo Curator writes no completion file there, only
    its SLURM-array markers in SLURM-array mode (``tally export --markers-from`` carries them).

    An actor already registered under that name is closed and killed first, with a warning: it can
    only be left over from a run whose driver was killed (NeMo Curator removes its actor at the end
    of every run), and adopting it would record this run in that run's checkpoint. One Ray cluster
    therefore runs one checkpointed pipeline at a time, as with NeMo Curator alone.

    After the block, an actor still registered (the run failed before NeMo Curator removed it) is
    closed and killed too. Run one ``pipeline.run`` per block: NeMo Curator removes the actor at
    the end of each run, so a second run in the same block would use NeMo Curator's own files.

    The writer's labels are, under ``labels``, the SLURM job and array ids and NeMo Curator shard
    ids (``NEMO_CURATOR_SLURM_ARRAY_SHARD_INDEX``...) of this process's environment: the actor runs
    with the Ray worker's environment, which need not have them.

    Args:
        checkpoint: Tally checkpoint name, e.g. ``curation/run-42``.
        address: Coordinator address, reachable from wherever Ray places the actor;
            ``TALLY_ADDRESS`` of this process (or ``127.0.0.1:50051``) when None.
        writer_id: Writer id; defaults to ``<hostname>-<pid>`` of the actor, new every run.
        labels: Free-form labels for status views.
        token: Bearer token, when the coordinator requires one; ``TALLY_TOKEN`` when None.
        timeout: Seconds a coordinator call may take; ``TALLY_TIMEOUT`` or the SDK's default
            when None.
        ray_address: Ray cluster to connect to when Ray is not initialized yet; ``"auto"`` (the
            ``RAY_ADDRESS`` variable or the local cluster) when None.
        max_attempts: Set the checkpoint's failure budget when the writer opens: a source reported
            failed that many times (:meth:`tally.Writer.report_failure`) is skipped until
            ``tally retry``. None leaves the budget as it is (0, unlimited, for a new checkpoint).
        claims: Claim the partitions the source stage runs (:meth:`tally.Writer.acquire`) and skip
            those another live writer holds, so pipelines started together on one checkpoint
            split the work. Off by default: NeMo Curator alone has no such mode.
        check_ray_limit: First check that the Ray head accepts the state queries NeMo Curator's
            XennaExecutor makes (:func:`check_state_api_limit`), so a head started without
            ``RAY_MAX_LIMIT_FROM_API_SERVER=40000`` fails here, in one line, and not inside Xenna
            once the run has started. Pass False with an executor that does not need it.
        trace: Record every call the pipeline makes to the actor (``wait``, ``are_completed``,
            ``apply_deltas``, ``close``), with timestamps and the coordinator's answers, to this JSONL
            file, written by the actor on its machine (a relative path is taken from this process's
            working directory); ``tally replay TRACE`` checks it against the counting rules.
            ``TALLY_TRACE`` of this process when None; no trace when that is unset.

    Raises:
        ImportError: Ray is not installed.
        RuntimeError: The Ray head refuses XennaExecutor's state queries (see ``check_ray_limit``).
        tally.TallyError: The actor could not open its writer (e.g. ``Unavailable``).
    """
    ray = _import_ray()
    # Read TALLY_* here, in the driver: the actor runs with the Ray worker's environment.
    env = ClientConfig.from_env()
    address = address or env.address
    token = token if token is not None else env.token
    timeout = timeout if timeout is not None else env.timeout
    labels = {**environment_labels(), **(labels or {})}
    trace = trace if trace is not None else os.environ.get(TRACE_ENV, "").strip() or None
    # The actor's working directory is Ray's: a relative path means the driver's.
    trace = os.path.abspath(trace) if trace else trace
    cls = ray.remote(num_cpus=0, max_concurrency=1)(TallyResumabilityProxy)
    with _ray_connection(ray, ray_address):
        if check_ray_limit:
            check_state_api_limit(ray)
        stale = _existing_actor(ray)
        if stale is not None:
            logger.warning(
                "replacing the resumability actor %r left by an earlier run (its driver was killed)",
                ACTOR_NAME,
            )
            _close_and_kill(ray, stale, "replacing a left-over actor")
        actor = cls.options(
            name=ACTOR_NAME, namespace=ACTOR_NAMESPACE, lifetime="detached", get_if_exists=False
        ).remote(
            address,
            checkpoint,
            writer_id=writer_id,
            labels=labels,
            token=token,
            timeout=timeout,
            max_attempts=max_attempts,
            claims=claims,
            trace=trace,
        )
        try:
            completed = ray.get(actor.wait.remote())
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(actor)
            raise
        # A failed actor constructor surfaces from ray.get as RayActorError wrapping the TallyError.
        logger.info("tally checkpoint %r: %s already completed", checkpoint, count(completed, "source"))
    try:
        yield
    finally:
        with _ray_connection(ray, ray_address):
            leftover = _existing_actor(ray)
            if leftover is not None:
                _close_and_kill(ray, leftover, "cleaning up after the run")
