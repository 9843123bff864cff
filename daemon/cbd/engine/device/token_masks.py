"""Token masks of constrained rows: host bitmasks staged to the device and applied to a step's logits.

A mask is `[rows, ceil(vocab / 32)]` int32, bit `v % 32` of word `v // 32` set where token v is allowed
(the layout grammar matchers fill). Rows without a grammar stay all ones, so their logits pass unchanged:
an unconstrained sequence samples the same token beside constrained ones as without them. The host
buffers are pinned and double-buffered: the buffer handed out for step N+1 is not the one whose copy
for step N may still be in flight (its copy event is waited for before reuse).
"""

from __future__ import annotations

import torch

from cbd.engine.device.streams import DeviceStreams


class TokenMasks:
    def __init__(self, streams: DeviceStreams, vocab_size: int) -> None:
        self.streams = streams
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self._host = [torch.empty(0, self.words, dtype=torch.int32), torch.empty(0, self.words, dtype=torch.int32)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self._shifts = torch.arange(32, dtype=torch.int32, device=streams.device)

    def buffer(self, num_rows: int) -> torch.Tensor:
        """A host [num_rows, words] bitmask with every token allowed."""
        i = self._next
        self._next ^= 1
        self.streams.synchronize(self._copied[i])  # its last copy to the device has finished
        if self._host[i].shape[0] < num_rows:
            self._host[i] = self.streams.pinned(max(num_rows, 2 * self._host[i].shape[0], 64) * self.words,
                                                torch.int32).view(-1, self.words)  # fmt: skip
            self._copied[i] = None
        buffer = self._host[i][:num_rows]
        buffer.fill_(-1)
        return buffer

    def stage(self, masks: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Copy a host bitmask to the device on the h2d stream; compute must wait for the event."""
        s = self.streams
        if not s.cuda:
            return masks, None
        with s.on(s.h2d):
            device_masks = masks.to(s.device, non_blocking=True)
            event = s.event()
            s.record(event, s.h2d)
        for i, host in enumerate(self._host):
            if host.numel() and masks.data_ptr() == host.data_ptr():
                self._copied[i] = event
        return device_masks, event

    def apply(self, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """logits [R, V] with the tokens that masks [R, words] disallow set to -inf (a new tensor)."""
        rows = logits.shape[0]
        bits = (masks[:rows].unsqueeze(-1) >> self._shifts) & 1  # [R, words, 32]
        allowed = bits.view(rows, -1)[:, : logits.shape[1]].bool()
        return logits.masked_fill(~allowed, float("-inf"))
