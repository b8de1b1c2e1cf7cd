"""Storage behind the domain ports.

NeMo Curator-compatible LMDB completion files (``lmdb_files``), the writers' journal
(``journal``), and the SQL registry of checkpoints, writers and events (``registry``, its tables
in ``registry_schema``); ``disk`` holds what they share about the disk and the trash folder.
"""
