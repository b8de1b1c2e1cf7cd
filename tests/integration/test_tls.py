"""TLS and mutual TLS on both transports, end to end, with certificates made here (``cryptography``).

One CA signs the server's certificate (127.0.0.1 and localhost) and a client's; a second CA signs
a client certificate the coordinator must refuse.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

import tally
from tally_server.testing import RunningServer, running_server
from tests.deploy.test_deploy_files import HTTP_PORT, dockerfile_stages, healthcheck_command
from tests.integration.workload import tree

TOKEN = "tls-worker"


# --- a small PKI --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> Pair:
    pair = Pair(directory / f"{stem}.crt", directory / f"{stem}.key")
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pair.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return pair


class Authority:
    """A CA that issues server and client certificates into ``directory``."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = directory / f"{name}.crt"
        self.pem.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        stem: str,
        *,
        server: bool,
        client: bool = False,
        names: Sequence[x509.GeneralName] | None = None,
    ) -> Pair:
        """A certificate for a server (127.0.0.1, localhost, or ``names``) or a client; ``client`` adds
        client use to a server's (what replicas of a store present to each other under mutual TLS)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(stem))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH] * server
                    + [ExtendedKeyUsageOID.CLIENT_AUTH] * (client or not server)
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    names or [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
        return _write(self.directory, stem, key, builder.sign(self.key, hashes.SHA256()))


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: Pair
    client: Pair
    stranger: Pair  # a client certificate from another CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, other = Authority(directory, "tally-test-ca"), Authority(directory, "other-ca")
    return Pki(
        ca.pem,
        ca.issue("server", server=True),
        ca.issue("client", server=False),
        other.issue("stranger", server=False),
    )


@pytest.fixture(scope="module")
def tls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    data = tmp_path_factory.mktemp("tls") / "data"
    with running_server(
        data,
        settle_ms=0,
        tls_cert=pki.server.cert,
        tls_key=pki.server.key,
        env={"TALLY_TOKENS": f"{TOKEN}:worker"},
    ) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    data = tmp_path_factory.mktemp("mtls") / "data"
    with running_server(
        data, settle_ms=0, tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=pki.ca
    ) as server:
        yield server


def urls(server: RunningServer) -> list[str]:
    return [server.grpc_url, server.http_url]


def round_trip(client: tally.Client, checkpoint: str) -> None:
    """Open a writer, apply, flush, ask: the whole write path over one connection."""
    with client.writer(checkpoint, writer_id="w") as w:
        w.apply_deltas(tree("a"))
        w.flush()
        assert w.are_completed(["a", "b"]) == [True, False]
    assert client.are_completed(checkpoint, ["a"]) == [True]


# --- TLS ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["grpcs", "https"])
def test_the_sdk_works_over_tls_with_its_ca(tls_server: RunningServer, pki: Pki, kind: str) -> None:
    url = tls_server.grpc_url if kind == "grpcs" else tls_server.http_url
    assert url.startswith(f"{kind}://")
    with tally.Client(url, token=TOKEN, ca_cert=pki.ca) as client:
        round_trip(client, f"tls/{kind}")
        # The watch stream rides the same TLS settings.
        first = next(iter(client.watch(f"tls/{kind}", interval_s=0.1)))
        assert first.completed_count == 1
    # A token is still required over TLS.
    with tally.Client(url, ca_cert=pki.ca) as anonymous:
        with pytest.raises(tally.Unauthenticated, match="bearer token"):
            anonymous.checkpoints()


@pytest.mark.parametrize("kind", ["grpcs", "https"])
def test_the_async_sdk_works_over_tls(tls_server: RunningServer, pki: Pki, kind: str) -> None:
    url = tls_server.grpc_url if kind == "grpcs" else tls_server.http_url

    async def main() -> None:
        async with tally.AsyncClient(url, token=TOKEN, ca_cert=pki.ca) as client:
            async with client.writer(f"tls-async/{kind}", writer_id="w") as w:
                w.apply_deltas(tree("a"))
                await w.flush()
                assert await w.are_completed(["a"]) == [True]
            async for status in client.watch(f"tls-async/{kind}", interval_s=0.1):
                assert status.completed_count == 1
                break

    asyncio.run(main())


def test_the_ca_comes_from_the_environment(
    tls_server: RunningServer, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TALLY_CA_CERT", str(pki.ca))
    monkeypatch.setenv("TALLY_TOKEN", TOKEN)
    for url in urls(tls_server):
        with tally.Client(url) as client:
            assert client.config.ca_cert == str(pki.ca)
            assert client.are_completed("tls/env", ["a"]) == [False]
    # Set once for a shell, it does not get in the way of a plain-text address.
    assert tally.ClientConfig.from_env({"TALLY_CA_CERT": str(pki.ca)}).ca_cert is None


@pytest.mark.parametrize("scheme", ["grpc", "http"])
def test_a_plain_text_client_is_refused_quickly(tls_server: RunningServer, scheme: str) -> None:
    address = tls_server.grpc_address if scheme == "grpc" else tls_server.http_address
    started = time.monotonic()
    with tally.Client(f"{scheme}://{address}", token=TOKEN, timeout=3) as client:
        with pytest.raises(tally.Unavailable, match=f"if the coordinator serves TLS, use an? {scheme}s://"):
            client.are_completed("tls/plain", ["a"])
    assert time.monotonic() - started < 20  # the timeout and its retries, not a hang


@pytest.mark.parametrize("kind", ["grpcs", "https"])
def test_a_server_certificate_from_an_unknown_ca_is_refused(
    tls_server: RunningServer, pki: Pki, kind: str, tmp_path: Path
) -> None:
    url = tls_server.grpc_url if kind == "grpcs" else tls_server.http_url
    # Trusting only another CA: the coordinator's certificate does not verify.
    other = Authority(tmp_path, "unrelated-ca")
    with tally.Client(url, token=TOKEN, ca_cert=other.pem, timeout=3) as client:
        with pytest.raises(tally.Unavailable, match="not signed by a CA this client trusts"):
            client.are_completed("tls/unknown-ca", ["a"])


def _trusting(ca: Path, client: Pair | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if client is not None:
        context.load_cert_chain(client.cert, client.key)
    return context


def _grpc_health(server: RunningServer, ca: Path, client: Pair | None = None) -> int:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )
    with grpc.secure_channel(server.grpc_address, credentials) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        return int(reply.status)


def test_health_checks_over_tls(tls_server: RunningServer, pki: Pki) -> None:
    with httpx.Client(verify=_trusting(pki.ca)) as http:
        assert http.get(f"{tls_server.http_url}/healthz").status_code == 200
        assert http.get(f"{tls_server.http_url}/readyz").status_code == 200
        assert http.get(f"{tls_server.http_url}/metrics").status_code == 200
    assert _grpc_health(tls_server, pki.ca) == health_pb2.HealthCheckResponse.SERVING


def test_the_image_healthcheck_follows_tls_cert(tls_server: RunningServer, pki: Pki) -> None:
    command = healthcheck_command(dockerfile_stages()[-1])
    code = command[2].replace(f"127.0.0.1:{HTTP_PORT}", tls_server.http_address)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}

    def run(extra: dict[str, str]) -> int:
        return subprocess.run(
            [sys.executable, "-c", code], env={**env, **extra}, capture_output=True, timeout=30
        ).returncode

    assert run({"TALLY_TLS_CERT": str(pki.server.cert)}) == 0
    assert run({}) != 0  # plain http against a TLS port


# --- mutual TLS ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["grpcs", "https"])
def test_mtls_accepts_a_client_certificate_from_its_ca(
    mtls_server: RunningServer, pki: Pki, kind: str
) -> None:
    url = mtls_server.grpc_url if kind == "grpcs" else mtls_server.http_url
    with tally.Client(url, ca_cert=pki.ca, client_cert=pki.client.cert, client_key=pki.client.key) as client:
        round_trip(client, f"mtls/{kind}")
        assert next(iter(client.watch(f"mtls/{kind}", interval_s=0.1))).completed_count == 1


@pytest.mark.parametrize("kind", ["grpcs", "https"])
@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate"])
def test_mtls_refuses_other_clients(mtls_server: RunningServer, pki: Pki, kind: str, who: str) -> None:
    url = mtls_server.grpc_url if kind == "grpcs" else mtls_server.http_url
    pair = {"no certificate": None, "another CA's certificate": pki.stranger}[who]
    files = {"client_cert": pair.cert, "client_key": pair.key} if pair else {}
    started = time.monotonic()
    with tally.Client(url, ca_cert=pki.ca, timeout=3, **files) as client:  # type: ignore[arg-type]
        with pytest.raises(tally.Unavailable, match="requires client certificates"):
            client.are_completed(f"mtls/refused-{kind}", ["a"])
    assert time.monotonic() - started < 20
    # Nothing it asked for exists.
    with tally.Client(url, ca_cert=pki.ca, client_cert=pki.client.cert, client_key=pki.client.key) as ok:
        assert f"mtls/refused-{kind}" not in {c.name for c in ok.checkpoints()}


def test_health_checks_over_mtls_need_a_client_certificate(mtls_server: RunningServer, pki: Pki) -> None:
    with httpx.Client(verify=_trusting(pki.ca, pki.client)) as http:
        assert http.get(f"{mtls_server.http_url}/readyz").status_code == 200
    assert _grpc_health(mtls_server, pki.ca, pki.client) == health_pb2.HealthCheckResponse.SERVING
    with httpx.Client(verify=_trusting(pki.ca)) as http, pytest.raises(httpx.TransportError):
        http.get(f"{mtls_server.http_url}/readyz")


# --- configuration mistakes ---------------------------------------------------------------------


def _serve(tmp_path: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    tally_cmd = Path(sys.executable).parent / "tally"
    command = [str(tally_cmd), "serve", "--data-dir", str(tmp_path / "data"), "--grpc-listen", "127.0.0.1:0"]
    command += ["--http-listen", "127.0.0.1:0", *map(str, args)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    env.update(COLUMNS="400", NO_COLOR="1")  # typer's error box must not wrap the message
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def test_serve_refuses_incomplete_or_mismatched_tls_files(tmp_path: Path, pki: Pki) -> None:
    alone = _serve(tmp_path, "--tls-cert", pki.server.cert)
    assert alone.returncode == 2 and "tls_cert and tls_key go together" in alone.stderr
    ca_only = _serve(tmp_path, "--tls-client-ca", pki.ca)
    assert ca_only.returncode == 2 and "needs tls_cert" in ca_only.stderr
    missing = _serve(tmp_path, "--tls-cert", tmp_path / "nope.crt", "--tls-key", pki.server.key)
    assert missing.returncode == 2 and "is not a readable file" in missing.stderr
    mismatched = _serve(tmp_path, "--tls-cert", pki.server.cert, "--tls-key", pki.client.key)
    assert mismatched.returncode == 1 and "cannot serve TLS" in mismatched.stderr


def test_the_sdk_refuses_tls_files_it_cannot_use(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not TLS; use grpcs://"):
        tally.Client("grpc://127.0.0.1:1", ca_cert=pki.ca)
    with pytest.raises(ValueError, match="client_cert and client_key go together"):
        tally.Client("grpcs://127.0.0.1:1", client_cert=pki.client.cert)
    for url in ("grpcs://127.0.0.1:1", "https://127.0.0.1:1"):
        with pytest.raises(ValueError, match="cannot be read"):
            tally.Client(url, ca_cert=tmp_path / "missing.pem")
        (tmp_path / "garbage.pem").write_text("not a certificate")
        with pytest.raises(ValueError, match="not a PEM file"):
            tally.AsyncClient(url, ca_cert=tmp_path / "garbage.pem")


# --- replicas of a PostgreSQL store forward over TLS ----------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mtls"])
def test_a_replica_forwards_to_the_owner_over_tls_with_a_ca_issued_certificate(
    tmp_path: Path, postgres_url: str, mutual: bool
) -> None:
    """The replicas share one certificate issued by a CA (for server and client use); a replica
    checks the owner's gRPC and HTTPS ports against it, and presents it under mutual TLS."""
    ca = Authority(tmp_path, "replicas-ca")
    shared = ca.issue("replica", server=True, client=True)
    tls = {"tls_cert": shared.cert, "tls_key": shared.key, "tls_client_ca": ca.pem if mutual else None}
    mine = {"client_cert": shared.cert, "client_key": shared.key} if mutual else {}
    with (
        running_server(tmp_path / "owner", settle_ms=0, store=postgres_url, **tls),  # type: ignore[arg-type]
        running_server(tmp_path / "replica", settle_ms=0, store=postgres_url, **tls) as replica,  # type: ignore[arg-type]
    ):
        assert "serving as a replica" in replica.log()
        for url in urls(replica):
            with tally.Client(url, ca_cert=ca.pem, **mine) as client:  # type: ignore[arg-type]
                round_trip(client, f"tls-replica/{url.split(':')[0]}")
                assert (
                    client.replicas().answered_by
                    != client.checkpoint(f"tls-replica/{url.split(':')[0]}").owner
                )
