"""Where an engine step's host time goes: a lap clock over the step's phases, filed as histograms.

The engine thread marks the end of each phase as it runs it (`lap`): the time since the previous mark is
that phase's. Laps of one phase within a step add up (an overlap step completes one step and launches the
next); `end_step` files each phase's total into its histogram (outputs.StepPhaseStats, exported as
`cbd_engine_step_phase_seconds{phase}`). One perf_counter per mark: cheap enough to stay on.

Phases (outputs.STEP_PHASES), in the order a turn of the engine loop runs them:
- intake: commands applied (requests and turns added, aborts, questions), saved KV read back;
- schedule: the next step planned (admission, growth, preemption, speculation, booking), restores issued;
- launch: its inputs packed and staged to the device, the forward and sampling enqueued;
- mask: grammar masks filled for constrained rows, their sampling enqueued;
- wait: waiting for the step in flight's tokens (the device's time not hidden behind the host's);
- book: the tokens put in place of their placeholders, full blocks registered for prefix sharing;
- emit: each row's output (stop checks, stop strings, finishing candidates);
- deliver: the stats snapshot, outputs handed to their owners and sent to the frontend.
"""

from __future__ import annotations

import time

from cbd.engine.outputs import STEP_PHASES, StepPhaseStats

INTAKE, SCHEDULE, LAUNCH, MASK, WAIT, BOOK, EMIT, DELIVER = range(len(STEP_PHASES))


class StepPhases:
    def __init__(self) -> None:
        self._mark = time.perf_counter()
        self._step = [0.0] * len(STEP_PHASES)
        self.stats = StepPhaseStats()

    def start(self) -> None:
        """A turn of the loop begins: what came before belongs to no phase."""
        self._mark = time.perf_counter()

    def lap(self, phase: int) -> None:
        """The time since the last mark was `phase`'s."""
        now = time.perf_counter()
        self._step[phase] += now - self._mark
        self._mark = now

    def end_step(self, ran: bool) -> None:
        """File this turn's phases if it ran a step (`ran`); an idle turn's are dropped."""
        if ran:
            for phase, seconds in enumerate(self._step):
                self.stats.observe(phase, seconds)
        self._step = [0.0] * len(STEP_PHASES)

    def snapshot(self) -> StepPhaseStats:
        """A copy for the stats snapshot (the engine thread keeps filing into its own)."""
        s = self.stats
        return StepPhaseStats([list(b) for b in s.buckets], list(s.seconds))
