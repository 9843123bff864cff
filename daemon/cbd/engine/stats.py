"""The engine's stats: one `EngineStats` snapshot read off its parts' counters.

Candidates are counted by seats (a fan-out's parent counts for the n it becomes once its prompt is
computed). The GPU-busy gauge reads CUDA events, which costs a little: at most once a second. Called from
the engine thread only (the threaded engine publishes the snapshot).
"""

from __future__ import annotations

import time

from cbd.engine.device.runner import ModelRunner
from cbd.engine.kv.disk_tier import DiskTier
from cbd.engine.kv.host_tier import HostTier
from cbd.engine.outputs import EngineStats, SpeculationStats, StepPhaseStats
from cbd.engine.sched.scheduler import Scheduler
from cbd.engine.sessions.manager import SessionManager


class StatsReader:
    def __init__(
        self, scheduler: Scheduler, sessions: SessionManager, host_tier: HostTier | None, runner: ModelRunner,
        disk: DiskTier | None = None,
    ) -> None:  # fmt: skip
        self.disk = disk
        self.scheduler = scheduler
        self.sessions = sessions
        self.host_tier = host_tier
        self.runner = runner
        self._gpu_busy_at = 0.0
        self._gpu_busy: float | None = None

    def read(self, num_steps: int, num_generated_tokens: int, step_phases: StepPhaseStats | None = None) -> EngineStats:
        scheduler, sessions = self.scheduler, self.sessions
        bm, spec = scheduler.block_manager, scheduler.speculator
        return EngineStats(
            num_running=sum(seq.seats for seq in scheduler.running),
            num_waiting=sum(seq.seats for seq in scheduler.waiting),
            num_blocks=bm.num_blocks,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_free=bm.num_free_blocks,
            num_blocks_cached=bm.num_cached_free_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_priority_preemptions=scheduler.num_priority_preemptions,
            num_steps=num_steps,
            num_generated_tokens=num_generated_tokens,
            num_sessions=len(sessions.sessions),
            num_session_evictions=sessions.eviction.num_evictions,
            gpu_busy=self.gpu_busy(),
            host=self.host_tier.stats(sessions.hits) if self.host_tier is not None else None,
            disk=self.disk.stats() if self.disk is not None else None,
            speculation=SpeculationStats(
                spec.num_speculative_steps, spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_device_drafted
            ),
            step_phases=step_phases,
        )

    def gpu_busy(self) -> float | None:
        now = time.monotonic()
        if now - self._gpu_busy_at > 1.0:
            self._gpu_busy_at, self._gpu_busy = now, self.runner.gpu_busy_fraction()
        return self._gpu_busy
