"""Reading a checkpoint's completion files: what it holds, and where its files are.

The read side of :class:`~tally_server.store.lmdb_files.LmdbCompletionStore`: loads (a set of ids,
or the hashes a compact index is built from), lookups that confirm an index hit, pages of ids in key
order, and the one place that maps a checkpoint name and writer id to a path inside the data dir.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from tally.integrations import nemo_format
from tally.integrations.nemo_format import FILE_SUFFIX, METADATA_DIRNAME, READ_ERRORS, describe_error
from tally_server.domain.compact import Hasher
from tally_server.domain.ports import LoadedCheckpoint, LoadedIndex, UnreadableFile
from tally_server.store.file_handles import HandleCache
from tally_server.store.lmdb_reads import FileReads

logger = logging.getLogger(__name__)

CHECKPOINTS_DIRNAME = "checkpoints"


class CompletionFolders:
    """The completion files of every checkpoint under ``<data_dir>/checkpoints``, read side.

    Args:
        data_dir: the server's data directory.
        max_open_files: how many handles of each kind (write, read) to keep open.
    """

    def __init__(self, data_dir: Path, max_open_files: int) -> None:
        self._data_dir = Path(data_dir).resolve()
        self._root = (self._data_dir / CHECKPOINTS_DIRNAME).resolve()
        # Keyed by resolved file path rather than (checkpoint, writer_id) so that two names that
        # reach the same file (a symlinked checkpoint folder) can never get two write handles.
        self._handles = HandleCache(max_open_files)
        self._reads = FileReads(self._handles, max_open_files)
        self._lookup_paths: dict[tuple[str, str], Path] = {}  # (checkpoint, origin) -> file, for contains

    def exists(self, checkpoint: str) -> bool:
        """Whether the checkpoint's ``.nemo_curator_metadata`` folder exists (creates nothing).

        The metadata folder, not the checkpoint folder, is the marker: ``a/b`` nests inside the
        folder of ``a``, which must not make ``a`` look like it exists.
        """
        self._handles.check_open()
        return self._folder(checkpoint).is_dir()

    def load(self, checkpoint: str) -> LoadedCheckpoint:
        """Union of every ``*.mdb`` in the checkpoint's metadata folder.

        ``unreadable`` lists the files that could not be read (with the error), whose contents are
        never counted: damaged files, links (never followed) and anything else that is not a
        regular file. Only a file without the ``completed_sources`` database reads as empty. A
        missing folder gives an empty result and creates nothing.
        """
        self._handles.check_open()
        folder = self._folder(checkpoint)
        result = LoadedCheckpoint(completed=set(), unreadable=[])
        if not folder.is_dir():
            return result
        for path in sorted(folder.glob(f"*{FILE_SUFFIX}")):
            try:
                with self._handles.lock(path):
                    sources = self._read(path)
            except READ_ERRORS as exc:
                error = describe_error(exc, path)  # the log line names the path already
                logger.warning(
                    "checkpoint %r: skipping unreadable completion file %s: %s", checkpoint, path, error
                )
                result.unreadable.append(UnreadableFile(path=str(path), error=error))
                continue
            result.completed |= sources
        return result

    def _read(self, path: Path) -> set[str]:
        """Completed ids in one file; the caller holds the file's lock."""
        cached = self._handles.get(path)
        if cached is not None:
            # Never open a second handle on a file this process holds open for writing.
            self._reads.check_tree(path, cached.env, cached.db)
            return nemo_format.read_ids(cached.env, cached.db)
        self._reads.forget(path)  # LMDB opens a file once per process
        env = nemo_format.open_env(path, write=False)
        try:
            db = nemo_format.open_completed_db(path, env)
            if db is None:
                return set()
            # A cursor walk of a damaged tree can abort the process: its pages are checked first.
            self._reads.check_tree(path, env, db)
            return nemo_format.read_ids(env, db)
        finally:
            env.close()

    def load_index(self, checkpoint: str, hasher: Hasher) -> LoadedIndex:
        """The sorted hashes of the ids in each readable ``*.mdb`` of the checkpoint (see ``load``).

        A file's origin is its name without ``.mdb`` (a writer's file is ``<writer_id>.mdb``).
        """
        self._handles.check_open()
        folder = self._folder(checkpoint)
        result = LoadedIndex(origins=[], hashes=[], files=[], unreadable=[])
        if not folder.is_dir():
            return result
        paths = sorted(folder.glob(f"*{FILE_SUFFIX}"))
        for path, hashes in zip(paths, self._reads.hash_files(paths, hasher), strict=True):
            if isinstance(hashes, BaseException):
                exc = hashes
                error = describe_error(exc, path)
                logger.warning(
                    "checkpoint %r: skipping unreadable completion file %s: %s", checkpoint, path, error
                )
                result.unreadable.append(UnreadableFile(path=str(path), error=error))
                continue
            result.origins.append(path.name[: -len(FILE_SUFFIX)])
            result.hashes.append(hashes)
            result.files.append(str(path))
        return result

    def contains(self, checkpoint: str, origin: str, keys: Sequence[bytes]) -> list[bool]:
        """Whether ``<origin>.mdb`` of the checkpoint holds each key.

        A file that cannot be read, or is missing, holds none.
        """
        self._handles.check_open()
        path = self._lookup_paths.get((checkpoint, origin))
        if path is None:  # resolving the folder costs more than the lookups it serves
            if len(self._lookup_paths) >= 4096:
                self._lookup_paths.clear()
            path = self._writer_file(self._folder(checkpoint), origin)
            self._lookup_paths[checkpoint, origin] = path
        return self._reads.contains(path, keys)

    def keys_after(
        self, checkpoint: str, origins: Sequence[str], after: bytes, limit: int
    ) -> tuple[list[bytes], bool]:
        """Up to ``limit`` distinct keys of these files greater than ``after``, in key order.

        Also says whether that is all of them.
        """
        self._handles.check_open()
        folder = self._folder(checkpoint)
        return self._reads.merged_keys_after([self._writer_file(folder, o) for o in origins], after, limit)

    def keys_matching(
        self, checkpoint: str, origins: Sequence[str], wanted: Callable[[bytes], bool]
    ) -> list[bytes]:
        """Every key of these files for which ``wanted`` is true (each file read in full)."""
        self._handles.check_open()
        folder = self._folder(checkpoint)
        found: list[bytes] = []
        for origin in origins:
            found += self._reads.keys_matching(self._writer_file(folder, origin), wanted)
        return found

    def _folder(self, checkpoint: str) -> Path:
        """The resolved metadata folder of ``checkpoint``, refusing anything outside the root.

        Names are validated upstream; this is defence in depth against a name (or a symlink)
        that would make us read or write outside ``<data_dir>/checkpoints``.
        """
        folder = (self._root / checkpoint / METADATA_DIRNAME).resolve()
        if folder.parent == self._root or not folder.parent.is_relative_to(self._root):
            raise ValueError(
                f"checkpoint {checkpoint!r} resolves to {folder}, outside {self._root}; refusing to touch it"
            )
        return folder

    @staticmethod
    def _writer_file(folder: Path, writer_id: str) -> Path:
        path = folder / f"{writer_id}{FILE_SUFFIX}"
        if not writer_id or writer_id in (".", "..") or path.parent != folder or "/" in writer_id:
            raise ValueError(f"writer_id {writer_id!r} does not name a file in {folder}; refusing")
        return path
