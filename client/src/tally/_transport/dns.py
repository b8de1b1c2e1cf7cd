"""A coordinator address whose host is a DNS name of several records: one replica per address.

``tally.Client("tally-replicas.example:50051")``, where the name has an A (or AAAA) record per
coordinator replica (a Kubernetes headless Service, a round-robin DNS name), is the same as
listing the addresses: ``10.0.0.5:50051,10.0.0.6:50051,...``. The name is looked up when the
client is made, with the system's resolver (``/etc/hosts``, search domains, DNS), and again
when a replica stops answering (at most every ``LOOKUP_EVERY_S``): replicas that left the name
are dropped, new ones join (``tally._transport.failover``).

Only the addresses of one family count: a name with both an A and an AAAA record is usually one
machine reached two ways (``localhost`` on many systems), not two replicas. The family with
more addresses wins, IPv4 on a tie. A name with one address of that family, or one that cannot
be looked up now, stays one address handed to the wire as it is (gRPC and httpx look it up
themselves on every connection), as before.

TLS and virtual hosting still see the name: a replica reached at an address is sent the name as
its gRPC authority or HTTP ``Host``, and its certificate must be the name's (gRPC checks it
against the authority; HTTPS asks for the name by SNI and checks it).

An ``AsyncClient`` made inside a coroutine looks the name up there, blocking its event loop for
the lookup (once); later lookups run on a thread.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import urllib.parse
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from tally._transport.base import Endpoint  # base imports this module lazily

logger = logging.getLogger(__name__)

# How often at most a failing replica sends the client to look its name up again.
LOOKUP_EVERY_S = 30.0

_AddrInfo = tuple[Any, Any, Any, Any, tuple[Any, ...]]  # what socket.getaddrinfo returns, per entry


def replicas_of(endpoint: Endpoint) -> list[Endpoint]:
    """``endpoint`` as one endpoint per address of its host name, or alone (see the module)."""
    return looked_up(endpoint) or [endpoint]


def looked_up(endpoint: Endpoint) -> list[Endpoint] | None:
    """As :func:`replicas_of`, but None if the name cannot be looked up now."""
    host, port = host_and_port(endpoint)
    if host is None or port is None or is_ip_literal(host):
        return [endpoint]
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        logger.info("tally could not look up %s now: %s", host, err)
        return None
    addresses = one_family(found)
    if len(addresses) < 2:
        return [endpoint]
    return [at_address(endpoint, host, address) for address in addresses]


def one_family(found: Iterable[_AddrInfo]) -> list[str]:
    """The distinct addresses of the family with most of them in ``found`` (IPv4 on a tie), in order."""
    by_family: dict[int, list[str]] = {socket.AF_INET: [], socket.AF_INET6: []}
    for family, _, _, _, sockaddr in found:
        addresses = by_family.get(int(family))
        if addresses is not None and sockaddr[0] not in addresses:
            addresses.append(str(sockaddr[0]))
    v4, v6 = by_family[socket.AF_INET], by_family[socket.AF_INET6]
    return v4 if len(v4) >= len(v6) else v6


def host_and_port(endpoint: Endpoint) -> tuple[str | None, int | None]:
    """The host and port ``endpoint`` connects to (the port the scheme implies if none is written)."""
    if endpoint.scheme == "http":
        parts = urllib.parse.urlsplit(endpoint.target)
        try:
            port = parts.port
        except ValueError:
            return None, None
        return parts.hostname, port if port is not None else (443 if endpoint.tls else 80)
    host, sep, port_text = endpoint.target.rpartition(":")
    if not sep or not port_text.isdigit():
        return None, None  # no port: gRPC's default applies, and the wire resolves the name itself
    return host.strip("[]"), int(port_text)


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def at_address(endpoint: Endpoint, host: str, address: str) -> Endpoint:
    """``endpoint`` connecting to ``address``, one of ``host``'s, still presenting ``host``."""
    shown = f"[{address}]" if ":" in address else address
    if endpoint.scheme == "http":
        parts = urllib.parse.urlsplit(endpoint.target)
        netloc = parts.netloc.rpartition("@")[2]
        port = f":{parts.port}" if parts.port is not None else ""
        target = urllib.parse.urlunsplit(parts._replace(netloc=f"{shown}{port}"))
        return replace(endpoint, target=target, authority=netloc, server_name=host)
    port = endpoint.target.rpartition(":")[2]
    return replace(endpoint, target=f"{shown}:{port}", authority=endpoint.target, server_name=host)
