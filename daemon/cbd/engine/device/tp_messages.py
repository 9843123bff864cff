"""Messages from rank 0 to the tensor-parallel workers: one small dataclass each, dispatched by type.

Per step: a `RunStep`, then, only when the step has constrained rows, a `SampleStep` with their masks
(rank 0 sends it once its grammars know the rows' masks); the worker samples at once otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

from cbd.engine.device.step_inputs import StepBatch


@dataclass(slots=True)
class Setup:
    """Sent once by rank 0's EngineCore: the pool and graphs every worker's ModelRunner must match."""

    num_blocks: int
    max_model_len: int
    graph_batch: int  # CUDA graphs up to this batch (0: none)
    verify_batch: int = 0  # verifying graphs up to this batch
    verify_queries: int = 1  # ... for at most this many tokens a sequence (1 + its drafts)


@dataclass(slots=True)
class WarmUp:
    pass


@dataclass(slots=True)
class RunStep:
    batch: StepBatch  # the packed step rank 0 stages for its own shard


@dataclass(slots=True)
class SampleStep:
    """The token masks of the last RunStep, sent when it has constrained rows (`StepMeta.masked`): the
    worker samples that step under them, as rank 0 does. The one way masks reach a worker."""

    masks: torch.Tensor  # [rows, ceil(vocab / 32)] int32 on the host


@dataclass(slots=True)
class StopWorkers:
    pass


WorkerMessage = Union[Setup, WarmUp, RunStep, SampleStep, StopWorkers]
