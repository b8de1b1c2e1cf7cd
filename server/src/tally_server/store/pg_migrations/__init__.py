"""The PostgreSQL store's Alembic environment: ``env.py``, the revision template and ``versions/``.

Run by ``store.pg_revisions`` (never through an ``alembic.ini``): a coordinator, a replica or a
command opening the store upgrades its tables to the newest revision first. The revision is kept in
``tally_store_version``, apart from the registry's ``alembic_version`` (both may share a database).
"""
