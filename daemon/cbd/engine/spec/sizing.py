"""Speculation's settings turned into what the engine is built with: the speculator, and the verifying
CUDA graphs (batch sizes and token counts) to capture at warm-up.

Verifying steps get graphs up to the batch where speculation runs: "auto"'s cap; with "ngram" at least 8;
never beyond 32 (each (batch, tokens) graph keeps its own logits rows), for up to 1 + num_speculative_tokens
tokens a sequence (cuda_graphs.verify_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from cbd.config import EngineConfig
from cbd.engine.kv.blocks import BlockManager
from cbd.engine.spec.agent_index import AgentIndex
from cbd.engine.spec.drafter import NgramDrafter
from cbd.engine.spec.speculator import Speculator


@dataclass(frozen=True, slots=True)
class VerifyGraphs:
    batch: int  # verifying graphs up to this batch (0: none)
    queries: int  # ... for at most this many tokens a sequence (1 + its drafts)


def verify_graphs(config: EngineConfig, graph_batch: int) -> VerifyGraphs:
    """graph_batch: the decode graphs' largest batch (0: no CUDA graphs, so no verifying graphs either)."""
    batch = 0
    if config.speculative == "auto":
        batch = min(graph_batch, config.speculative_max_batch, 32)
    elif config.speculative == "ngram":
        batch = min(graph_batch, max(config.speculative_max_batch, 8), 32)
    return VerifyGraphs(batch, config.num_speculative_tokens + 1 if batch else 1)


def new_speculator(config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> Speculator:
    """The speculator for these settings ("off": one without a drafter, which never drafts)."""
    on = config.speculative != "off"
    agents = AgentIndex(config.speculative_index_tokens) if on and config.speculative_index_tokens else None
    drafter = NgramDrafter(agents) if on else None
    max_batch = config.speculative_max_batch if config.speculative == "auto" else None
    return Speculator(block_manager, max_model_len, drafter, config.num_speculative_tokens, max_batch, agents)
