"""Constrained decoding: grammars compiled with xgrammar, a matcher per sequence, the token masks of a step's
constrained rows filled on the host (staged and applied by device/), and the JSON-schema allow-list. Imports only
the engine's request types and sched/plan.py: never the core, the device step or the threaded engine."""
