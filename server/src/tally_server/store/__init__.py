"""Storage behind the domain ports: NeMo Curator-compatible LMDB completion files
(``lmdb_files``) and the SQL registry of checkpoints, writers and events (``registry``)."""
