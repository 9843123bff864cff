"""Fault injection for tests of the daemon's failure handling (`CBD_INJECT_FAULT`, off unless set).

stall:<step>:<seconds>   the engine loop sleeps before step <step> (a wedged engine)
error:<step>             step <step> raises: the requests in it fail, the engine goes on
device-error:<step>      step <step> raises a device error: every request fails, the engine stops
                         and the daemon exits non-zero (so systemd restarts it)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


class DeviceFault(RuntimeError):
    """A failure of the accelerator itself (CUDA error, lost device): the process cannot go on."""


def is_device_fault(exc: BaseException) -> bool:
    if isinstance(exc, DeviceFault):
        return True
    text = f"{type(exc).__name__}: {exc}"
    return "CUDA error" in text or "AcceleratorError" in text or "device-side assert" in text


@dataclass(slots=True)
class FaultPlan:
    kind: str
    step: int
    seconds: float = 0.0

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        spec = os.environ.get("CBD_INJECT_FAULT", "")
        if not spec:
            return None
        parts = spec.split(":")
        if parts[0] not in ("stall", "error", "device-error") or len(parts) < 2:
            raise ValueError(f"CBD_INJECT_FAULT: unknown fault {spec!r}")
        return cls(parts[0], int(parts[1]), float(parts[2]) if len(parts) > 2 else 0.0)

    def before_step(self, step: int) -> None:
        if step != self.step:
            return
        self.step = -1  # once
        if self.kind == "stall":
            time.sleep(self.seconds)
        elif self.kind == "error":
            raise RuntimeError(f"injected fault at step {step}")
        else:
            raise DeviceFault(f"injected device error at step {step}")
