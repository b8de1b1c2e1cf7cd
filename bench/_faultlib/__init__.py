"""The fault campaign's scenarios (``bench/faults.py``), shared with the fast tests in ``tests/fault/``."""
