"""Client and AsyncClient over a shared base that does no I/O (httpx-style build/send)."""

from tally._calls import IMPORT_CHUNK
from tally._client.aio import AsyncClient
from tally._client.sync import Client

__all__ = ["IMPORT_CHUNK", "AsyncClient", "Client"]
