"""A DNS name with a record per coordinator replica, against real ``tally serve`` processes.

The name lives in an ``/etc/hosts`` of the client's own: the client runs in a private mount namespace
(``unshare -rm``) where a file of the test is bound over ``/etc/hosts``, so the SDK looks the name up
through the system's resolver (``getaddrinfo``), as it would a Kubernetes headless Service. The
replicas share one PostgreSQL store and listen on one port each for gRPC and HTTP, on loopback
addresses of their own (127.0.0.2, 127.0.0.3): what a name's records give, addresses on one port.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509

from tally_server.testing import RunningServer, running_server
from tests.integration.test_pg_replicas import samples_of
from tests.integration.test_tls import Authority

pytestmark = pytest.mark.postgres

REPO = Path(__file__).resolve().parents[2]
NAME = "replicas.tally.test"
DEAD = "127.0.0.4"  # a loopback address nothing listens on: connections to it are refused


def private_hosts_possible() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30, check=False)
    return done.returncode == 0


pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(
        not private_hosts_possible(),
        reason="needs `unshare -rm` (user and mount namespaces) to give the client an /etc/hosts of its own",
    ),
]


def write_hosts(path: Path, *addresses: str) -> None:
    """``NAME``'s records, in this order (rewritten in place: the bind mount sees the same file)."""
    lines = ["127.0.0.1 localhost", *(f"{address} {NAME}" for address in addresses)]
    with path.open("r+" if path.exists() else "w") as f:
        f.truncate(0)
        f.write("\n".join(lines) + "\n")


def client_process(hosts: Path, script: str, *args: str) -> subprocess.Popen[str]:
    """``script`` in this environment's Python, seeing ``hosts`` as /etc/hosts; talks on stdin/stdout."""
    prelude = textwrap.dedent(
        f"""
        import json, logging, socket, sys
        import tally
        from tally._transport import dns, failover
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
        # Start on the dead record, so it is met first (the resolver orders the records its own way).
        order = dns.one_family(socket.getaddrinfo({NAME!r}, 1, type=socket.SOCK_STREAM))
        failover.first_replica = lambda count: order.index({DEAD!r}) if {DEAD!r} in order else 0
        def say(**what): print(json.dumps(what), flush=True)
        def wait_for(word): assert sys.stdin.readline().strip() == word
        """
    )
    command = 'mount --bind "$1" /etc/hosts && shift && exec "$@"'
    return subprocess.Popen(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            command,
            "sh",
            str(hosts),
            sys.executable,
            "-c",
            prelude + script,
            *args,
        ],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def heard(process: subprocess.Popen[str]) -> dict[str, object]:
    """The client's next report; its log if it ended instead."""
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        _, err = process.communicate(timeout=60)
        raise AssertionError(f"the client ended (exit {process.returncode}) without a report:\n{err}")
    return json.loads(line)


def tell(process: subprocess.Popen[str], word: str) -> None:
    assert process.stdin is not None
    process.stdin.write(word + "\n")
    process.stdin.flush()


def finished(process: subprocess.Popen[str]) -> str:
    """Wait for the client to end well; its log."""
    _, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return err


@contextlib.contextmanager
def replica_at(
    tmp_path: Path, url: str, address: str, ports: tuple[int, int] | None = None
) -> Iterator[RunningServer]:
    """A coordinator of store ``url`` listening on ``address`` (the ports given, else free ones)."""
    grpc_port, http_port = ports or (0, 0)
    with running_server(
        tmp_path / address,
        store=url,
        settle_ms=0,
        grpc_listen=f"{address}:{grpc_port}",
        http_listen=f"{address}:{http_port}",
    ) as server:
        yield server


def ports_of(server: RunningServer) -> tuple[int, int]:
    return int(server.grpc_address.rpartition(":")[2]), int(server.http_address.rpartition(":")[2])


def reads_answered(server: RunningServer, wire: str) -> float:
    """How many are_completed calls ``server`` answered: as the owner over ``wire``, or as a replica
    by itself (its own metrics; read without checking a TLS server's certificate, which names none
    of the addresses here)."""
    text = httpx.get(f"{server.http_url}/metrics", verify=False).text
    local = samples_of(text, "tally_replica_local_calls_total").get('{call="AreCompleted"}', 0.0)
    if wire == "grpc":
        samples = samples_of(text, "tally_grpc_request_duration_seconds_count")
        return local + sum(
            v for labels, v in samples.items() if "AreCompleted" in labels and 'code="OK"' in labels
        )
    samples = samples_of(text, "tally_http_request_duration_seconds_count")
    return local + sum(
        v for labels, v in samples.items() if "/v1/are-completed" in labels and 'status="200"' in labels
    )


WRITE_AND_READ = """
from tests.integration.workload import tree
address, checkpoint = sys.argv[1], sys.argv[2]
with tally.Client(address, timeout=60) as client:
    replicas = client._transport.replicas
    with client.writer(checkpoint, writer_id="w") as writer:
        writer.apply_deltas(tree("a"))
        writer.flush()
    answers = [client.are_completed(checkpoint, ["a", "b"]) for _ in range(30)]
say(replicas=replicas, answers=answers)
"""


@pytest.mark.parametrize("wire", ["grpc", "http"])
def test_a_name_with_a_record_per_replica_spreads_reads_and_moves_past_a_dead_record(
    tmp_path: Path, postgres_url: str, wire: str
) -> None:
    """Records: a dead address first, then two replicas of one store. The writer's first call meets
    the dead one and moves on; 30 reads go round the replicas, and both answer some."""
    with (
        replica_at(tmp_path, postgres_url, "127.0.0.2") as owner,
        replica_at(tmp_path, postgres_url, "127.0.0.3", ports_of(owner)) as replica,
    ):
        grpc_port, http_port = ports_of(owner)
        hosts = tmp_path / "hosts"
        write_hosts(hosts, DEAD, "127.0.0.2", "127.0.0.3")
        address = f"{NAME}:{grpc_port}" if wire == "grpc" else f"http://{NAME}:{http_port}"
        client = client_process(hosts, WRITE_AND_READ, address, "dns/spread")
        report = heard(client)
        log = finished(client)

        port = grpc_port if wire == "grpc" else http_port
        shown = (
            f"grpc://{{}}:{port} ({NAME}:{port})" if wire == "grpc" else f"http://{{}}:{port} ({NAME}:{port})"
        )
        assert sorted(report["replicas"]) == [shown.format(a) for a in ("127.0.0.2", "127.0.0.3", DEAD)]
        assert report["answers"] == [[True, False]] * 30
        assert f"tally coordinator {shown.format(DEAD)} is unavailable, moving to" in log
        assert reads_answered(owner, wire) >= 5 and reads_answered(replica, wire) >= 5


FOLLOW_THE_NAME = """
from tally._transport import failover
from tests.integration.workload import tree
failover.LOOKUP_EVERY_S = 0.0  # look the name up again at every failure
address, checkpoint = sys.argv[1], sys.argv[2]
with tally.Client(address, timeout=60) as client:
    with client.writer(checkpoint, writer_id="w") as writer:
        writer.apply_deltas(tree("before"))
        writer.flush()
        say(replicas=client._transport.replicas)
        wait_for("go")
        writer.apply_deltas(tree("after"))
        writer.flush()
        answers = client.are_completed(checkpoint, ["before", "after"])
    say(replicas=client._transport.replicas, answers=answers)
"""


def test_the_client_follows_the_names_records_when_its_replicas_go(tmp_path: Path, postgres_url: str) -> None:
    """The name first has the owner and a dead record. A second replica starts, the records become
    the two replicas, and the owner stops: the writer, whose replicas were both gone, finds the new
    one by looking the name up again, re-attaches through it and loses nothing."""
    hosts = tmp_path / "hosts"
    with replica_at(tmp_path, postgres_url, "127.0.0.2") as owner:
        grpc_port, _ = ports_of(owner)
        write_hosts(hosts, "127.0.0.2", DEAD)
        client = client_process(hosts, FOLLOW_THE_NAME, f"{NAME}:{grpc_port}", "dns/follow")
        first = sorted(heard(client)["replicas"])
        assert first == [f"grpc://{a}:{grpc_port} ({NAME}:{grpc_port})" for a in ("127.0.0.2", DEAD)]
        with replica_at(tmp_path, postgres_url, "127.0.0.3", ports_of(owner)) as newcomer:
            write_hosts(hosts, "127.0.0.2", "127.0.0.3")
            assert owner.terminate() == 0
            tell(client, "go")
            report = heard(client)
            log = finished(client)
            then = sorted(report["replicas"])
            assert then == [
                f"grpc://{a}:{grpc_port} ({NAME}:{grpc_port})" for a in ("127.0.0.2", "127.0.0.3")
            ]
            assert report["answers"] == [True, True]
            assert "tally coordinator replicas are now" in log
            assert newcomer.process.poll() is None


TLS_READS = """
address, ca = sys.argv[1], sys.argv[2]
with tally.Client(address, timeout=30, ca_cert=ca) as client:
    answers = [client.are_completed("dns/tls", ["a"]) for _ in range(6)]
    say(replicas=client._transport.replicas, answers=answers)
"""


@pytest.mark.parametrize("scheme", ["grpcs", "https"])
def test_each_replica_of_a_name_is_held_to_the_names_certificate(tmp_path: Path, scheme: str) -> None:
    """Certificates name only the DNS name, not the addresses: a client that checked each replica's
    certificate against the address it connected to would refuse them all. Two coordinators (each on
    its own data dir) answer reads over TLS through the name."""
    authority = Authority(tmp_path, "dns-ca")
    pair = authority.issue("replicas", server=True, names=[x509.DNSName(NAME)])
    tls = {"tls_cert": pair.cert, "tls_key": pair.key, "settle_ms": 0}
    with running_server(tmp_path / "a", grpc_listen="127.0.0.2:0", http_listen="127.0.0.2:0", **tls) as a:
        grpc_port, http_port = ports_of(a)
        with running_server(
            tmp_path / "b", grpc_listen=f"127.0.0.3:{grpc_port}", http_listen=f"127.0.0.3:{http_port}", **tls
        ) as b:
            hosts = tmp_path / "hosts"
            write_hosts(hosts, "127.0.0.2", "127.0.0.3")
            port = grpc_port if scheme == "grpcs" else http_port
            client = client_process(hosts, TLS_READS, f"{scheme}://{NAME}:{port}", str(authority.pem))
            report = heard(client)
            finished(client)
            assert len(report["replicas"]) == 2
            assert report["answers"] == [[False]] * 6
            wire = "grpc" if scheme == "grpcs" else "http"
            assert reads_answered(a, wire) == 3 and reads_answered(b, wire) == 3
