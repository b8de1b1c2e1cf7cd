"""Tally coordinator: domain core, stores and the gRPC + HTTP transports."""

__version__ = "0.1.0"
