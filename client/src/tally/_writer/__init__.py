"""Writers: a pure, clock-injected core (``core``) and its two drivers, threads and asyncio."""

from tally._writer.aio import AsyncWriter
from tally._writer.base import WriterBase
from tally._writer.support import default_writer_id
from tally._writer.threaded import Writer

__all__ = ["AsyncWriter", "Writer", "WriterBase", "default_writer_id"]
