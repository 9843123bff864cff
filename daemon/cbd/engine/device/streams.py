"""The three CUDA streams of the overlap loop and the events that order them; no-ops on CPU.

  h2d      copies a step's staged inputs from pinned host memory to the device
  compute  waits for its step's h2d event, then runs block copies, carry-over, forward, sampling
  d2h      waits for its step's compute event, copies the sampled tokens to pinned host memory

The host blocks only on a step's d2h event (`synchronize`), to read its tokens. On CPU every
stream is None, every event is None and every call here returns at once, so the same loop code
runs (synchronously) in CI.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class DeviceStreams:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            self.h2d: torch.cuda.Stream | None = torch.cuda.Stream(device)
            self.compute: torch.cuda.Stream | None = torch.cuda.Stream(device)
            self.d2h: torch.cuda.Stream | None = torch.cuda.Stream(device)
        else:
            self.h2d = self.compute = self.d2h = None

    def event(self) -> torch.cuda.Event | None:
        return torch.cuda.Event() if self.cuda else None

    @contextlib.contextmanager
    def on(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with torch.cuda.stream(stream):
            yield

    @staticmethod
    def record(event: torch.cuda.Event | None, stream: torch.cuda.Stream | None) -> None:
        if event is not None:
            event.record(stream)

    @staticmethod
    def wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def synchronize(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def pinned(self, size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, pin_memory=self.cuda)
