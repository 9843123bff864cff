"""What an EngineCore is made of, sized from the config and the model: the KV pool (blocks, context
length), the model runner with its CUDA graphs (decode and verifying), the host tier, the session
manager and the scheduler with its speculator; the tensor-parallel workers are told the same sizes.

Sizes are decided here once: `num_kv_blocks`, else as many blocks as `kv_cache_gib` holds (at least 2);
the context is the model's (or `max_model_len`), never more than the pool holds; decode graphs up to
`min(cuda_graph_max_batch, max_num_seqs)`; no host tier with tensor parallelism (each rank would have
to move its own shard).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cbd.config import EngineConfig
from cbd.engine.device.runner import ModelRunner
from cbd.engine.device.tp_messages import Setup
from cbd.engine.kv.blocks import BlockManager
from cbd.engine.kv.disk_tier import DiskTier
from cbd.engine.kv.host_tier import HostTier
from cbd.engine.sched.scheduler import Scheduler
from cbd.engine.sequence import Sequence
from cbd.engine.sessions.checkpoints import SessionCheckpoints
from cbd.engine.sessions.manager import SessionManager
from cbd.engine.spec.sizing import new_speculator, verify_graphs
from cbd.model import blas, swiglu_gemm
from cbd.model.loader import LoadedModel


@dataclass(slots=True)
class CoreParts:
    max_model_len: int
    block_manager: BlockManager
    runner: ModelRunner
    host_tier: HostTier | None
    sessions: SessionManager
    checkpoints: SessionCheckpoints | None  # sessions saved to disk_kv_dir (None: not saved)
    scheduler: Scheduler
    overlap: bool  # keep one step in flight (see core.py)
    free_target: int  # with a host tier, idle sessions are copied out while fewer GPU blocks are free


def build_parts(
    loaded: LoadedModel, config: EngineConfig, tp_group: Any, new_fork: Callable[[Sequence, int, list[int]], Sequence]
) -> CoreParts:
    """tp_group: rank 0's TensorParallelGroup, or None. new_fork: the scheduler's fan-out hook (the core's)."""
    spec = loaded.spec
    bs = config.block_size
    block_bytes = ModelRunner.kv_bytes_per_block(loaded.model, bs, config.kv_cache_dtype)
    num_blocks = config.num_kv_blocks or max(2, int(config.kv_cache_gib * 2**30) // block_bytes)
    max_model_len = min(config.max_model_len or spec.max_position_embeddings, num_blocks * bs)
    block_manager = BlockManager(num_blocks, bs, config.enable_prefix_caching)
    graph_batch = min(config.cuda_graph_max_batch, config.max_num_seqs) if config.cuda_graphs else 0
    verify = verify_graphs(config, graph_batch)
    blas.select(config.blas_library, loaded.model.embed_tokens.weight.device)
    swiglu_gemm.install(config.fused_swiglu, loaded.model)
    runner = ModelRunner(
        loaded.model, num_blocks, bs, max_model_len, config.attention_backend, graph_batch,
        config.kv_cache_dtype, verify.batch, verify.queries,
    )  # fmt: skip
    host_tier = None
    if tp_group is None:
        host_tier = HostTier.from_config(config, runner.kv_caches, runner.streams, block_manager, block_bytes)
    sessions = SessionManager(block_manager, config.max_sessions, config.session_ttl, host_tier)
    disk = DiskTier.from_config(config, loaded, runner.kv_caches, host_tier)
    checkpoints = SessionCheckpoints(sessions, disk, config.disk_kv_spill) if disk is not None else None
    scheduler = Scheduler(
        block_manager, config.max_num_seqs, config.max_num_batched_tokens, reclaim=sessions.eviction.evict,
        max_model_len=max_model_len, new_fork=new_fork, host_tier=host_tier,
        aging_seconds=config.priority_aging_seconds, warm_first_seconds=config.warm_first_seconds,
        speculator=new_speculator(config, block_manager, max_model_len),
    )  # fmt: skip
    if scheduler.speculator.agents is not None:
        sessions.on_closed.append(scheduler.speculator.agents.drop)
    if tp_group is not None:
        tp_group.broadcast(Setup(num_blocks, max_model_len, graph_batch, verify.batch, verify.queries))
        runner.broadcast = tp_group.broadcast
    overlap = config.overlap_enabled(runner.device)
    scheduler.speculator.backoff = overlap  # there, looking for drafts at every step costs the step host time
    return CoreParts(
        max_model_len,
        block_manager,
        runner,
        host_tier,
        sessions,
        checkpoints,
        scheduler,
        overlap,
        max(1, num_blocks // 20),
    )
