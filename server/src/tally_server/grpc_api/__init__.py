"""gRPC transport: translates tally.v1 messages to service calls and errors to status codes."""
