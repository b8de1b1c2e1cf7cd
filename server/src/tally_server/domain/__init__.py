"""The pure domain core: counting rules, writers, checkpoints. Imports no I/O library."""
