"""The registry's Alembic environment: ``env.py``, the revision template and ``versions/``.

Run by ``store.registry_migrations`` (never through an ``alembic.ini``): the coordinator upgrades
its registry to the newest revision when it starts.
"""
