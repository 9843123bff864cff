"""A step's inputs: packed on the CPU into one int64 and one float32 array, staged through two buffers.

Packing: every per-token, per-sequence and per-row array of the step goes into one flat int64
list (and the float sampling parameters into one float32 list), so a step costs two host-to-device
copies whatever its shape. `PackedStep.view` slices the device copy back into named tensors.

Double buffering: step N+1 is staged into the buffer pair that step N is *not* reading. Before
the host overwrites a pinned buffer it waits for that buffer's previous copy (`h2d_done`); before
the copy overwrites the device buffer, the h2d stream waits until compute has finished reading it
(`consumed`). On CPU the device buffer is the host buffer and the events are None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cbd.engine.streams import DeviceStreams


@dataclass(slots=True)
class PackedStep:
    """Host-side packing of one step; `add` appends a named int64 array, `add_float` a float32 one."""

    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)
    int_fields: dict[str, tuple[int, int]] = field(default_factory=dict)
    float_fields: dict[str, tuple[int, int]] = field(default_factory=dict)

    def add(self, name: str, values: list[int]) -> None:
        if len(self.ints) % 2:
            self.ints.append(0)  # 16-byte aligned views: kernels see one alignment, so compile once
        self.int_fields[name] = (len(self.ints), len(values))
        self.ints += values

    def add_float(self, name: str, values: list[float]) -> None:
        self.floats += [0.0] * (-len(self.floats) % 4)
        self.float_fields[name] = (len(self.floats), len(values))
        self.floats += values


@dataclass(slots=True)
class StagedStep:
    """Device views of one packed step, and the buffer slot that holds them."""

    tensors: dict[str, torch.Tensor]
    slot: _Slot

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)


class _Slot:
    def __init__(self, streams: DeviceStreams) -> None:
        self.streams = streams
        self.host_i = self.dev_i = torch.empty(0, dtype=torch.int64)
        self.host_f = self.dev_f = torch.empty(0, dtype=torch.float32)
        self.h2d_done = streams.event()  # the last copy out of host_i/host_f has finished
        self.consumed = streams.event()  # compute has finished reading dev_i/dev_f

    def ensure(self, num_ints: int, num_floats: int) -> None:
        if num_ints <= self.host_i.numel() and num_floats <= self.host_f.numel():
            return
        # Growing replaces tensors an in-flight step may still read: wait for it (rare).
        self.streams.synchronize(self.consumed)
        num_ints = max(num_ints, 2 * self.host_i.numel(), 4096)
        num_floats = max(num_floats, 2 * self.host_f.numel(), 1024)
        s = self.streams
        self.host_i = s.pinned(num_ints, torch.int64)
        self.host_f = s.pinned(num_floats, torch.float32)
        if s.cuda:
            self.dev_i = torch.empty(num_ints, dtype=torch.int64, device=s.device)
            self.dev_f = torch.empty(num_floats, dtype=torch.float32, device=s.device)
        else:
            self.dev_i, self.dev_f = self.host_i, self.host_f


class InputStager:
    def __init__(self, streams: DeviceStreams) -> None:
        self.streams = streams
        self.slots = [_Slot(streams), _Slot(streams)]
        self._next = 0

    def stage(self, packed: PackedStep) -> StagedStep:
        """Copy `packed` to the device on the h2d stream; compute must `wait(staged.slot.h2d_done)`."""
        slot = self.slots[self._next]
        self._next ^= 1
        s = self.streams
        s.synchronize(slot.h2d_done)  # the pinned buffer is free again (long since, in practice)
        n_i, n_f = len(packed.ints), len(packed.floats)
        slot.ensure(n_i, n_f)
        if n_i:
            slot.host_i[:n_i] = torch.tensor(packed.ints, dtype=torch.int64)
        if n_f:
            slot.host_f[:n_f] = torch.tensor(packed.floats, dtype=torch.float32)
        if s.cuda:
            with s.on(s.h2d):
                s.wait(s.h2d, slot.consumed)  # step N-1 (same slot) has finished reading the device copy
                if n_i:
                    slot.dev_i[:n_i].copy_(slot.host_i[:n_i], non_blocking=True)
                if n_f:
                    slot.dev_f[:n_f].copy_(slot.host_f[:n_f], non_blocking=True)
                s.record(slot.h2d_done, s.h2d)
        tensors = {name: slot.dev_i[o : o + n] for name, (o, n) in packed.int_fields.items()}
        tensors.update({name: slot.dev_f[o : o + n] for name, (o, n) in packed.float_fields.items()})
        return StagedStep(tensors, slot)

    def release(self, staged: StagedStep) -> None:
        """Called on the compute stream after the step's last read of its staged tensors."""
        self.streams.record(staged.slot.consumed, self.streams.compute)
