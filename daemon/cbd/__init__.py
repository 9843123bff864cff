"""cbd: a continuous-batching daemon for LLM agent workloads."""

__version__ = "0.1.0"
