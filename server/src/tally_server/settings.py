"""Server settings: flags of ``tally serve``, ``TALLY_*`` environment variables, sane defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tally_server.domain.validation import Limits


def split_listen(value: str) -> tuple[str, int]:
    """``"127.0.0.1:8080"`` → ``("127.0.0.1", 8080)``; ``"[::1]:0"`` → ``("::1", 0)``."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"listen address {value!r} must be HOST:PORT (PORT 0 picks a free port)")
    if not 0 <= int(port) <= 65535:
        raise ValueError(f"listen address {value!r} has port {port} outside 0-65535")
    return host.strip("[]"), int(port)


class Settings(BaseSettings):
    """Everything ``tally serve`` can be told. Each field is also ``TALLY_<FIELD>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="TALLY_", extra="forbid")

    data_dir: Path = Field(
        default=Path("./tally-data"),
        description="Where completion files (checkpoints/<name>/.nemo_curator_metadata/*.mdb) and the "
        "default SQLite registry live.",
    )
    grpc_listen: str = Field(default="127.0.0.1:50051", description="gRPC HOST:PORT; port 0 picks one.")
    http_listen: str = Field(default="127.0.0.1:8080", description="HTTP HOST:PORT; port 0 picks one.")
    registry_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL of the registry (checkpoints, writers, events); default the store's "
        "database when store is set, else SQLite in data_dir. PostgreSQL: postgresql+psycopg://user@host:5432/db.",
        json_schema_extra={"default_text": "the store's database with store, else SQLite in data_dir"},
    )
    store: str | None = Field(
        default=None,
        description="Where completions and writers' journals live. Unset: LMDB files in NeMo Curator's "
        "format in data_dir (and the journal in data_dir/journal.log). A PostgreSQL URL "
        "(postgresql+psycopg://user@host:5432/db; postgresql:// means the same): both in that "
        "database, nothing under data_dir/checkpoints. Several coordinators given one store form one "
        "service: one owns the store (an advisory lock and a fencing epoch) and applies every writer's "
        "deltas; the others are replicas that answer are_completed from the database, forward all "
        "other calls to the owner and take the store over when it goes.",
        json_schema_extra={"default_text": "unset: LMDB files in data_dir"},
    )
    standby: bool = Field(
        default=False,
        description="With store: if another coordinator owns the store, wait listening on no port (instead "
        "of serving as a replica) and take over as soon as it is gone, with its writers' journals; every "
        "commit is fenced by the store's epoch, so a deposed coordinator writes nothing. Without store: "
        "refused.",
    )
    store_shards: int | None = Field(
        default=None,
        ge=1,
        le=256,
        description="With store: how many shards a new store is made with (fixed from then on; unset: 1). "
        "With one shard one coordinator owns the whole store and the others are replicas of it; with more, "
        "each coordinator on the store owns some shards (a checkpoint's shard is a hash of its name) and "
        "applies their writers' deltas, so writes spread over the replicas. Given for a store made with "
        "another number: refused.",
        json_schema_extra={"default_text": "the store's own; 1 for a new store"},
    )
    replica_name: str | None = Field(
        default=None,
        max_length=200,
        description="This coordinator's name among the store's replicas (shown by status views and the "
        "dashboard); default HOSTNAME-PID. Unique per store.",
        json_schema_extra={"default_text": "HOSTNAME-PID"},
    )
    replica_cache_ids: int = Field(
        default=2_000_000,
        ge=0,
        description="With store, on a replica: how many completed ids it keeps in memory to answer "
        "are_completed without asking the database for them (about 100 bytes each); whole checkpoints "
        "are evicted past it, least recently asked first. A checkpoint's cached ids are trusted only "
        "while none of its completions has gone (the store numbers each removal), so they are never "
        "staler than the database. 0: every id is asked of the database.",
    )
    advertise_host: str | None = Field(
        default=None,
        max_length=253,
        description="The host other replicas of the store reach this one at (the ports are the listening "
        "ones); default the listening host, or this machine's hostname when listening on all addresses "
        "(on Kubernetes give the pod's IP).",
        json_schema_extra={"default_text": "the listening host"},
    )
    settle_ms: int = Field(
        default=250,
        ge=0,
        le=600_000,
        description="How long a source whose count reached zero waits before it is completed; any delta "
        "for it meanwhile cancels. 0 completes at once, exactly like NeMo Curator's actor.",
    )
    lease_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description="A writer that sends nothing (not even a heartbeat) for this long is closed and its "
        "pending state dropped.",
    )
    progress_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="How often each checkpoint's completed count is sampled into the registry (when it "
        "changed; and once when the checkpoint is created), for the progress plot and rate; samples "
        "survive restarts.",
    )
    checkpoint_memory_mb: int = Field(
        default=1024,
        gt=0,
        description="Memory for loaded completed-id sets, in MiB. Past it, checkpoints without live "
        "writers are unloaded, least recently used first, and loaded again when next asked about; "
        "status and listings never load them. The writers' journal log's live state in memory counts "
        "against it too.",
    )
    journal: bool = Field(
        default=True,
        description="Journal every live writer's accepted batches (in <data_dir>/journal.log, or in the "
        "store's database with store), so that a "
        "restart, crash or upgrade of the coordinator loses none of their pending state and they carry "
        "on. Off: writers open at a restart are lost and their unfinished sources replay (faster; for "
        "measuring what the journal costs).",
    )
    journal_snapshot_deltas: int = Field(
        default=100_000,
        gt=0,
        description="A writer's journal entries give way to a snapshot of its state after this many "
        "deltas (or twice its state's size, if more), so a journal stays within a few times the state "
        "of its writers however long they run.",
    )
    ledger_core: Literal["auto", "compiled", "python"] = Field(
        default="auto",
        description="Where live writers' pending counts and task-id dedup maps are kept: the compiled "
        "counting core (built when tally-server is installed with a C compiler at hand; faster, and "
        "about 40 bytes less per task id a live writer remembers) or Python dicts (the same rules). auto "
        "takes the compiled core when it was built; compiled refuses to start without it.",
    )
    shutdown_grace_s: float = Field(
        default=10.0, ge=0, description="On SIGTERM, how long in-flight requests may take to finish."
    )
    http_keepalive_s: int = Field(
        default=75,
        gt=0,
        description="How long an idle HTTP connection is kept open for the client's next request. Keep it "
        "above the idle timeout of the clients and proxies in front (httpx 5 s, AWS ALB 60 s): a client "
        "that sends on a connection just as the server closes it gets a failed request.",
    )
    max_deltas_per_call: int = Field(default=100_000, gt=0, description="Deltas accepted per ApplyDeltas.")
    max_ids_per_query: int = Field(default=100_000, gt=0, description="Source ids accepted per AreCompleted.")
    max_id_bytes: int = Field(
        default=511,
        gt=0,
        le=511,
        description="Longest task or source id, in UTF-8 bytes (source ids are LMDB keys: at most 511).",
    )
    max_labels: int = Field(default=64, gt=0, description="Labels (and fingerprint components) per writer.")
    max_name_bytes: int = Field(default=255, gt=0, description="Longest checkpoint name or writer id.")
    max_writers_per_checkpoint: int = Field(
        default=10_000, gt=0, description="Live writers allowed on one checkpoint."
    )
    max_message_bytes: int = Field(
        default=64 * 1024 * 1024,
        gt=0,
        description="Largest gRPC message accepted or sent, and largest HTTP request body (413 above it).",
    )
    tokens: str | None = Field(
        default=None,
        description="Bearer tokens with roles, 'TOKEN:ROLE' separated by commas (roles: reader, worker, "
        "admin). 'TOKEN:ROLE@PREFIX' limits the entry to checkpoints whose name starts with PREFIX "
        "(e.g. 'team-a/'); a token listed in several entries gets every grant. Unset (and no "
        "tokens_file): authentication is off. Give them as TALLY_TOKENS or in tokens_file rather than "
        "as a flag: every user of the machine sees a command line (ps).",
        json_schema_extra={"default_text": "unset: authentication off"},
    )
    tokens_file: Path | None = Field(
        default=None,
        description="File with one 'TOKEN:ROLE' or 'TOKEN:ROLE@PREFIX' per line ('#' comments), added "
        "to tokens.",
    )
    metrics_auth: bool = Field(
        default=False,
        description="Require a bearer token for GET /metrics (reader role or higher, not limited to a "
        "prefix: the metrics name every checkpoint). Off by default, so Prometheus scrapes without a "
        "token; has no effect while authentication is off.",
    )
    tls_cert: Path | None = Field(
        default=None,
        description="PEM certificate (chain) to serve TLS with on both the gRPC and the HTTP port; needs "
        "tls_key. Unset: both listen in plain text.",
    )
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert.")
    tls_client_ca: Path | None = Field(
        default=None,
        description="PEM CA certificate(s): clients must present a certificate signed by one of them "
        "(mutual TLS) on both ports; needs tls_cert. Tokens, if configured, are still required.",
    )
    log_level: str = Field(default="INFO", description="Python logging level name.")
    log_format: Literal["text", "json"] = Field(default="text", description="Log line format.")

    @field_validator("grpc_listen", "http_listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        split_listen(value)
        return value

    @field_validator("tokens")
    @classmethod
    def _tokens(cls, value: str | None) -> str | None:
        from tally_server.auth import parse_tokens

        parse_tokens(value or "")  # refused at start, naming what is wrong (never a token)
        return value

    @field_validator("ledger_core")
    @classmethod
    def _ledger_core(cls, value: str) -> str:
        from tally_server.domain import idmap

        if value == "compiled" and idmap.COMPILED is None:
            raise ValueError(idmap.MISSING)
        return value

    @field_validator("registry_url")
    @classmethod
    def _registry_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        from tally_server.store.registry import registry_url

        return registry_url(value).render_as_string(hide_password=False)

    @field_validator("store")
    @classmethod
    def _store(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        from tally_server.store.postgres import store_url

        return store_url(value).render_as_string(hide_password=False)

    @model_validator(mode="after")
    def _standby(self) -> Self:
        if self.standby and self.store is None:
            raise ValueError(
                "standby needs store: a standby takes over a PostgreSQL store that another coordinator "
                "serves (LMDB files in a data directory belong to one coordinator); give --store too"
            )
        if self.store_shards is not None and self.store is None:
            raise ValueError(
                "store_shards needs store: shards spread a PostgreSQL store over several coordinators (LMDB "
                "files in a data directory belong to one coordinator); give --store too, or leave it out"
            )
        if self.store_shards not in (None, 1) and self.standby:
            raise ValueError(
                "standby serves a store of one shard (it waits for the store's single owner); on a store of "
                "several shards every coordinator serves and owns some shards: leave --standby out"
            )
        return self

    @model_validator(mode="after")
    def _tls(self) -> Self:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both to serve TLS, or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key to serve TLS with")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path: Path | None = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"{name} {str(path)!r} is not a readable file; give the path of a PEM file")
        return self

    @property
    def tls(self) -> bool:
        """Whether TLS is configured (a certificate was given)."""
        return self.tls_cert is not None

    @property
    def limits(self) -> Limits:
        """The refusal limits these settings set."""
        return Limits(
            max_deltas_per_call=self.max_deltas_per_call,
            max_ids_per_query=self.max_ids_per_query,
            max_id_bytes=self.max_id_bytes,
            max_name_bytes=self.max_name_bytes,
            max_writers_per_checkpoint=self.max_writers_per_checkpoint,
            max_labels=self.max_labels,
        )

    def resolved_registry_url(self) -> str:
        """The registry URL: the one configured, else the store's database, else SQLite in data_dir."""
        from tally_server.store.registry import default_sqlite_url

        return self.registry_url or self.store or default_sqlite_url(self.data_dir)

    def resolved_replica_name(self) -> str:
        """This coordinator's name among the store's replicas: the one configured, else HOSTNAME-PID."""
        import os
        import socket

        return self.replica_name or f"{socket.gethostname()}-{os.getpid()}"

    def advertised(self, listen: str, port: int) -> str:
        """``HOST:PORT`` other replicas reach a port bound to ``listen`` (at ``port``) at."""
        import socket

        host = self.advertise_host
        if host is None:
            bound, _ = split_listen(listen)
            host = socket.gethostname() if bound in ("0.0.0.0", "::", "") else bound
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
