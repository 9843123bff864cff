"""The gRPC boundary: converts, validates and delegates to the engine."""
