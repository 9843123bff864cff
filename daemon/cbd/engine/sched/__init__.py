"""Planning a step: the plan types (plan.py), who runs and how many tokens, growth, preemption and the
plan's booking (scheduler.py), the order of waiting requests by class and fair share (order.py) and
their admission (admit.py).

Imports only lower engine modules (sequence, sampling_params), kv/ and spec/; never the core, the
engine or their helpers (tests/unit/test_engine_layers.py).
"""
