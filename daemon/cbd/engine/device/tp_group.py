"""Tensor-parallel ranks on one host, started by the engine itself (no external launcher).

Rank 0 is the engine thread of the daemon: it schedules, owns the block manager and the outputs,
and before running each step on its own shard it broadcasts the packed step (the same arrays it
stages for its GPU, in a typed `RunStep` message of tp_messages.py) on a gloo control group. Ranks
1..N-1 are spawned processes that load their shard, build the same ModelRunner and replay every broadcast step: same kernels, same CUDA graphs,
same collectives in the same order (NCCL on CUDA, gloo on CPU). Every rank samples the same tokens
from the gathered logits, so the carry-over of the overlap loop works unchanged on each.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cbd.config import EngineConfig
from cbd.engine.device.tp_messages import RunStep, SampleStep, Setup, StopWorkers, WarmUp, WorkerMessage
from cbd.lifetime import die_with_parent

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(config: EngineConfig, rank: int) -> torch.device:
    device = config.torch_device()
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _init(rank: int, world: int, port: int, device: torch.device) -> dist.ProcessGroup:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return dist.new_group(backend="gloo")  # the control plane: pickled step plans


class TensorParallelGroup:
    """Rank 0's handle: spawns the workers, joins the process group, broadcasts commands."""

    def __init__(self, config: EngineConfig) -> None:
        self.world = config.tensor_parallel_size
        port = _free_port()
        ctx = mp.get_context("spawn")
        values = dataclasses.asdict(config)
        self.procs = [
            ctx.Process(target=_worker_main, args=(rank, self.world, port, values), name=f"cbd-tp{rank}", daemon=True)
            for rank in range(1, self.world)
        ]
        for p in self.procs:
            p.start()
        self.device = _rank_device(config, 0)
        self.ctrl = _init(0, self.world, port, self.device)
        log.info("tensor parallel: %d ranks on %s", self.world, self.device.type)

    def broadcast(self, message: WorkerMessage) -> None:
        dist.broadcast_object_list([message], src=0, group=self.ctrl)

    def stop(self, timeout: float = 30.0) -> None:
        try:
            self.broadcast(StopWorkers())
        finally:
            for p in self.procs:
                p.join(timeout)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()


def _worker_main(rank: int, world: int, port: int, values: dict[str, Any]) -> None:
    from cbd.engine.device.runner import ModelRunner
    from cbd.model import blas, swiglu_gemm
    from cbd.model.loader import load_model

    die_with_parent()  # a rank never outlives the engine that started it (killed, or crashed)

    config = EngineConfig(**values)
    device = _rank_device(config, rank)
    ctrl = _init(rank, world, port, device)

    def receive() -> WorkerMessage:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=ctrl)
        return box[0]

    loaded = load_model(
        config.model, config.cache_dir, device, config.torch_dtype(), pack_cpu_gemm=config.cpu_packed_gemm,
        tensor_parallel=(rank, world),
    )  # fmt: skip
    setup = receive()  # from rank 0's EngineCore
    assert isinstance(setup, Setup), setup
    blas.select(config.blas_library, device)
    swiglu_gemm.install(config.fused_swiglu, loaded.model)
    runner = ModelRunner(
        loaded.model, setup.num_blocks, config.block_size, setup.max_model_len, config.attention_backend,
        setup.graph_batch, config.kv_cache_dtype, setup.verify_batch, setup.verify_queries,
    )  # fmt: skip
    previous = None
    while True:
        message = receive()
        if type(message) is RunStep:
            step = runner.launch(message.batch)
            if previous is not None:
                runner.streams.synchronize(previous.done)  # at most one step in flight, like rank 0
            previous = step
        elif type(message) is SampleStep:
            assert previous is not None and previous.pending is not None
            runner.sample_masked(previous, message.masks)  # the step's constrained rows: same masks, same tokens
        elif type(message) is WarmUp:
            runner.warm_up()
        elif type(message) is StopWorkers:
            break
        else:
            raise TypeError(f"unknown tensor-parallel message {message!r}")
    dist.destroy_process_group()
