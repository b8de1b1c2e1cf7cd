"""Integrations of the Tally SDK with pipeline frameworks (NeMo Curator drop-in, generic tracker)."""
