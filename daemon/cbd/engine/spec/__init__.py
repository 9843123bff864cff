"""Speculative decoding: draft tokens (drafter.py), the per-step draft state, backoff and verification
(speculator.py), and which verifying graphs to capture (sizing.py).

Imports only lower engine modules (sequence, cuda_graphs), kv/blocks.py and sched/plan.py (the plan
types); never the scheduler, the core or the engine (tests/unit/test_engine_layers.py).
"""
