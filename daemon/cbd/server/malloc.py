"""glibc malloc setting for a long-running process whose tensors change size every step.

By default glibc raises its mmap threshold each time a large mmapped block is freed; from then on
large tensors come from the heap, whose free space fragments and is seldom returned to the system,
so the resident size creeps up over hours of varying batch shapes. Pinning the threshold keeps large
allocations in their own mappings, which go back to the system when freed.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)
DEFAULT_THRESHOLD = 1 << 20


def pin_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold (no dynamic raising); False where this is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
