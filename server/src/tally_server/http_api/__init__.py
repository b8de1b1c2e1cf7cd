"""HTTP transport (FastAPI): the same operations as gRPC under /v1, plus health endpoints."""
