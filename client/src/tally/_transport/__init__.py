"""The wire: one transport interface (``base``), gRPC and HTTP behind it, each with its converter."""
