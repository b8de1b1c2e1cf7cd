"""A sweep of malformed requests over both transports, then two checks that the server is still sound.

Every answer must be a refusal with a 4xx status or a gRPC code other than INTERNAL/UNKNOWN (an
accepted request is fine where the input is merely odd); the log must hold no traceback; a refused
OpenWriter must leave no writer behind; and a writer that goes silent must still expire.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import grpc
import httpx

from tally.v1 import coordinator_pb2 as pb
from tally_server.testing import RunningServer

from .common import Row, scratch, serve, tracebacks, wait_for

CHECKPOINT = "fault/sweep"
LEASE_TTL_S = 2.0
BIG = 2**63
SERVICE = "/tally.v1.Coordinator/"
OK = "OK"


@dataclass
class Answer:
    case: str
    got: str  # "HTTP 400" or a gRPC status code name
    expected: frozenset[str]

    @property
    def error(self) -> bool:
        """A server error: HTTP 5xx, gRPC INTERNAL or UNKNOWN."""
        return self.got.startswith("HTTP 5") or self.got in ("INTERNAL", "UNKNOWN")

    @property
    def as_expected(self) -> bool:
        return self.got in self.expected


@dataclass
class SweepResult:
    answers: list[Answer]
    tracebacks: int
    writers_left_live: list[str] = field(default_factory=list)
    silent_writer_expired: bool = True

    @property
    def errors(self) -> list[Answer]:
        return [a for a in self.answers if a.error]

    @property
    def unexpected(self) -> list[Answer]:
        return [a for a in self.answers if not a.error and not a.as_expected]


def _statuses(*codes: int) -> frozenset[str]:
    return frozenset(f"HTTP {c}" for c in codes)


def _codes(*names: str) -> frozenset[str]:
    return frozenset(names)


class _Sweep:
    def __init__(self, server: RunningServer) -> None:
        self.server = server
        # One connection per request: a case that makes the server drop its connection (uvicorn
        # does after an unhandled error) must not fail the next case on a reused one.
        self.http = httpx.Client(base_url=server.http_url, timeout=30, headers={"connection": "close"})
        self.channel = grpc.insecure_channel(server.grpc_address)
        self.answers: list[Answer] = []
        self.refused_opens: list[str] = []  # writer ids whose OpenWriter was refused
        self._n = 0

    def close(self) -> None:
        self.http.close()
        self.channel.close()

    # ---------------------------------------------------------------- helpers

    def handle(self) -> str:
        """A fresh live writer of the sweep's checkpoint."""
        self._n += 1
        reply = self.http.post(
            "/v1/writers", json={"checkpoint": CHECKPOINT, "writer_id": f"sweep-{self._n}"}
        )
        reply.raise_for_status()
        return str(reply.json()["handle"])

    def http_case(
        self, case: str, expected: frozenset[str], method: str, path: str, **kwargs: object
    ) -> httpx.Response | None:
        try:
            reply = self.http.request(method, path, **kwargs)  # type: ignore[arg-type]
        except httpx.HTTPError as exc:
            self.answers.append(Answer(case, f"connection failed: {type(exc).__name__}", expected))
            return None
        self.answers.append(Answer(case, f"HTTP {reply.status_code}", expected))
        return reply

    def raw_http_case(self, case: str, expected: frozenset[str], request: bytes) -> None:
        host, port = self.server.http_address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(request)
            head = sock.recv(4096).split(b"\r\n", 1)[0].decode("latin-1")
        parts = head.split()
        got = f"HTTP {parts[1]}" if len(parts) > 1 and parts[1].isdigit() else f"no status line: {head!r}"
        self.answers.append(Answer(case, got, expected))

    def grpc_case(self, case: str, expected: frozenset[str], method: str, request: bytes) -> None:
        call = self.channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
        try:
            call(request, timeout=30)
            got = OK
        except grpc.RpcError as err:
            got = err.code().name
        self.answers.append(Answer(case, got, expected))

    def grpc_stream_case(self, case: str, expected: frozenset[str], method: str, request: bytes) -> None:
        call = self.channel.unary_stream(
            SERVICE + method, request_serializer=None, response_deserializer=None
        )
        stream = call(request, timeout=10)
        try:
            next(iter(stream))
            got = OK
        except grpc.RpcError as err:
            got = err.code().name
        finally:
            stream.cancel()  # type: ignore[no-untyped-call]
        self.answers.append(Answer(case, got, expected))

    def open_case(self, case: str, expected: frozenset[str], **fields: object) -> None:
        writer_id = str(fields.setdefault("writer_id", f"open-{len(self.answers)}"))
        reply = self.http_case(
            case, expected, "POST", "/v1/writers", json={"checkpoint": CHECKPOINT, **fields}
        )
        if reply is not None and reply.status_code != 200:
            self.refused_opens.append(writer_id)

    def deltas_case(self, case: str, expected: frozenset[str], delta: object) -> None:
        body = {"deltas": [{"task_id": "t", "source_id": "s", "delta": delta}]}
        self.http_case(case, expected, "POST", f"/v1/writers/{self.handle()}/deltas", json=body)

    # ---------------------------------------------------------------- the sweep

    def run(self) -> None:
        bad, ok_or_bad = _statuses(400), _statuses(200, 400)
        self.handle()  # the sweep's checkpoint exists (a refused open creates nothing)
        # Numbers out of range at the edge (2^63 overflows SQLite; PostgreSQL's pid is 32-bit).
        self.open_case("HTTP OpenWriter pid 2^63", bad, writer_id="big-pid", pid=BIG)
        self.open_case("HTTP OpenWriter pid -1", ok_or_bad, writer_id="neg-pid", pid=-1)
        for param, value, expected in [
            ("before_id", BIG, bad),
            ("before_id", -1, ok_or_bad),
            ("limit", BIG, ok_or_bad),
            ("limit", -1, ok_or_bad),
        ]:
            self.http_case(
                f"HTTP ListEvents {param}={value}",
                expected,
                "GET",
                "/v1/events",
                params={"checkpoint": CHECKPOINT, param: value},
            )
        self.http_case(
            "HTTP ListWriters limit=2^63",
            ok_or_bad,
            "GET",
            "/v1/writers",
            params={"checkpoint": CHECKPOINT, "limit": BIG},
        )
        self.http_case(
            "HTTP ListCompleted limit=2^63",
            ok_or_bad,
            "GET",
            "/v1/completed",
            params={"checkpoint": CHECKPOINT, "limit": BIG},
        )
        self.http_case(
            "HTTP GetProgress since=nan",
            ok_or_bad,
            "GET",
            "/v1/progress",
            params={"checkpoint": CHECKPOINT, "since": "nan"},
        )
        # Deltas are strict integers within int64.
        for label, delta in [("true", True), ('"1"', "1"), ("1.5", 1.5), ("2^63", BIG)]:
            self.deltas_case(f"HTTP delta {label}", bad, delta)
        self.http_case(
            "HTTP batch_seq -1",
            ok_or_bad,
            "POST",
            f"/v1/writers/{self.handle()}/deltas",
            json={"deltas": [], "batch_seq": -1},
        )
        # Names and handles.
        self.http_case("HTTP GET /v1/checkpoints/a%0Ab", bad, "GET", "/v1/checkpoints/a%0Ab")
        host = self.server.http_address
        # Raw: httpx itself refuses URLs this long.
        self.raw_http_case(
            "HTTP 100 KB handle",
            _statuses(400, 404, 414, 431),
            (
                f"POST /v1/writers/{'h' * 100_000}/keepalive HTTP/1.1\r\n"
                f"Host: {host}\r\nContent-Length: 0\r\n\r\n"
            ).encode(),
        )
        self.open_case("HTTP 1 MB checkpoint name", bad, checkpoint="c" * 1_000_000)
        self.open_case("HTTP labels not strings", bad, labels={"a": 1})
        self.open_case(
            "HTTP 10,000 fingerprint components",
            _statuses(400, 429),
            fingerprint={f"k{i}": "v" for i in range(10_000)},
        )
        self.http_case("HTTP reset name ..", bad, "POST", "/v1/reset", json={"name": ".."})
        self.http_case(
            "HTTP import_id ../x",
            bad,
            "POST",
            "/v1/import",
            json={"checkpoint": CHECKPOINT, "source_ids": ["a"], "import_id": "../x"},
        )
        self.http_case(
            "HTTP source_ids a string",
            bad,
            "POST",
            "/v1/are-completed",
            json={"checkpoint": CHECKPOINT, "source_ids": "abc"},
        )
        # Bodies that are not what they claim.
        json_headers = {"content-type": "application/json"}
        self.http_case(
            "HTTP non-UTF-8 body",
            bad,
            "POST",
            "/v1/are-completed",
            content=b'{"checkpoint": "\xff\xfe", "source_ids": ["\xc3"]}',
            headers=json_headers,
        )
        self.http_case(
            "HTTP invalid JSON", bad, "POST", "/v1/writers", content=b'{"checkpoint": ', headers=json_headers
        )
        self.http_case(
            "HTTP JSON array body", bad, "POST", "/v1/writers", content=b"[]", headers=json_headers
        )
        depth = 100_000
        self.http_case(
            "HTTP JSON nested 100,000 deep",
            _statuses(400, 413),
            "POST",
            "/v1/are-completed",
            content=b"[" * depth + b"]" * depth,
            headers=json_headers,
        )
        self.raw_http_case(
            "HTTP declared body over the limit",
            _statuses(413),
            (
                f"POST /v1/are-completed HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {64 * 1024 * 1024 + 1}\r\n\r\n{{}}"
            ).encode(),
        )

        # gRPC: undecodable bytes must be INVALID_ARGUMENT on every method, streams included.
        invalid = _codes("INVALID_ARGUMENT")
        not_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (a string) holding two bytes that are not UTF-8
        garbage = b"\xff\xff\xff\xff"
        self.grpc_stream_case("gRPC WatchCheckpoint non-UTF-8", invalid, "WatchCheckpoint", not_utf8)
        self.grpc_stream_case("gRPC WatchCheckpoint garbage bytes", invalid, "WatchCheckpoint", garbage)
        for method in ("OpenWriter", "ApplyDeltas", "AreCompleted", "ListEvents"):
            self.grpc_case(f"gRPC {method} garbage bytes", invalid, method, garbage)
        self.grpc_case(
            "gRPC KeepAlive 100 KB handle",
            _codes("NOT_FOUND", "INVALID_ARGUMENT"),
            "KeepAlive",
            pb.KeepAliveRequest(handle="h" * 100_000).SerializeToString(),
        )
        self.grpc_case(
            "gRPC AreCompleted 100 KB checkpoint name",
            invalid,
            "AreCompleted",
            pb.AreCompletedRequest(checkpoint="c" * 100_000, source_ids=["a"]).SerializeToString(),
        )
        self.grpc_case(
            "gRPC GetCheckpoint a\\nb",
            invalid,
            "GetCheckpoint",
            pb.GetCheckpointRequest(name="a\nb").SerializeToString(),
        )
        ok_or_invalid = _codes(OK, "INVALID_ARGUMENT")
        for label, before in [("2^63-1", BIG - 1), ("-1", -1)]:
            self.grpc_case(
                f"gRPC ListEvents before_id {label}",
                ok_or_invalid,
                "ListEvents",
                pb.ListEventsRequest(checkpoint=CHECKPOINT, before_id=before).SerializeToString(),
            )
        self.grpc_case(
            "gRPC ListWriters limit -1",
            ok_or_invalid,
            "ListWriters",
            pb.ListWritersRequest(checkpoint=CHECKPOINT, limit=-1).SerializeToString(),
        )
        self.grpc_case(
            "gRPC ListCompleted limit 2^31-1",
            ok_or_invalid,
            "ListCompleted",
            pb.ListCompletedRequest(checkpoint=CHECKPOINT, limit=2**31 - 1).SerializeToString(),
        )
        self.grpc_case(
            "gRPC OpenWriter pid 2^63-1",
            ok_or_invalid,
            "OpenWriter",
            pb.OpenWriterRequest(checkpoint=CHECKPOINT, writer_id="max-pid", pid=BIG - 1).SerializeToString(),
        )
        self.grpc_case(
            "gRPC ApplyDeltas delta 2^63-1",
            ok_or_invalid,
            "ApplyDeltas",
            pb.ApplyDeltasRequest(
                handle=self.handle(),
                deltas=[
                    pb.Delta(task_id="a", source_id="s", delta=BIG - 1),
                    pb.Delta(task_id="b", source_id="s", delta=BIG - 1),
                ],
            ).SerializeToString(),
        )
        self.grpc_case(
            "gRPC ImportCompleted import_id ../x",
            invalid,
            "ImportCompleted",
            pb.ImportCompletedRequest(
                checkpoint=CHECKPOINT, source_ids=["a"], import_id="../x"
            ).SerializeToString(),
        )
        self.grpc_case(
            "gRPC ResetCheckpoint empty name",
            invalid,
            "ResetCheckpoint",
            pb.ResetCheckpointRequest().SerializeToString(),
        )

    def writers_left_live(self) -> list[str]:
        """Writer ids whose OpenWriter was refused yet that block a normal open of the same id."""
        left = []
        for writer_id in self.refused_opens:
            if not writer_id or len(writer_id) > 200:
                continue
            reply = self.http.post("/v1/writers", json={"checkpoint": CHECKPOINT, "writer_id": writer_id})
            if reply.status_code == 409:
                left.append(writer_id)
        return left

    def silent_writer_expires(self) -> bool:
        """A writer that sends nothing after opening is dropped within its lease (plus slack)."""
        self.http.post(
            "/v1/writers", json={"checkpoint": CHECKPOINT, "writer_id": "silent"}
        ).raise_for_status()

        def gone() -> bool:
            reply = self.http.get("/v1/writers", params={"checkpoint": CHECKPOINT, "limit": 1000})
            return reply.status_code == 200 and "silent" not in {
                w["writer_id"] for w in reply.json()["writers"]
            }

        # The lease loop looks every TTL/4 (at most 1 s); the rest is slack for a busy machine.
        return wait_for(gone, LEASE_TTL_S * 2 + 4, interval=0.25)


def sweep(server: RunningServer) -> SweepResult:
    log_before = len(server.log())
    sweeper = _Sweep(server)
    try:
        sweeper.run()
        count = tracebacks(server.log()[log_before:])
        result = SweepResult(sweeper.answers, count)
        result.writers_left_live = sweeper.writers_left_live()
        result.silent_writer_expired = sweeper.silent_writer_expires()
    finally:
        sweeper.close()
    return result


def run() -> Row:
    row = Row("bad_requests")
    with scratch("sweep") as base, serve(base / "data", lease_ttl_s=LEASE_TTL_S) as server:
        started = time.monotonic()
        result = sweep(server)
        row.figures["sweep_s"] = time.monotonic() - started
    row.trials = len(result.answers)
    row.errors = len(result.errors)
    row.notes.append(f"{len(result.answers)} requests, {result.tracebacks} tracebacks in the log")
    for answer in result.errors:
        row.notes.append(f"{answer.case}: {answer.got}")
    for answer in result.unexpected:
        row.notes.append(f"{answer.case}: {answer.got}, want {'/'.join(sorted(answer.expected))}")
    row.check(not result.unexpected, f"{len(result.unexpected)} requests answered unlike the contract")
    row.check(result.tracebacks == 0, f"{result.tracebacks} tracebacks in the server log")
    row.check(not result.writers_left_live, f"refused opens left writers live: {result.writers_left_live}")
    row.check(result.silent_writer_expired, "a silent writer never expired (the lease loop stopped)")
    row.figures["answers"] = [(a.case, a.got) for a in result.answers]
    return row
