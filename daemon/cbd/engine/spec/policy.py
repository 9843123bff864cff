"""When a step should verify drafts: the step costs measured on the device, and what each sequence keeps.

A decode step of B sequences runs the CUDA graph of (B, 1); the same step verifying up to k drafts per
sequence runs the verifying graph of (B, Q), Q the smallest captured query count >= 1 + k, B rounded up
to the graphs' batch bucket. Both are timed at warm-up (DecodeGraphs.measure). A step's drafts are worth
it when the tokens it expects per millisecond beat the plain step's:

    (B + sum_i E[kept_i]) / cost(B, Q)  >  B / cost(B, 1),    E[kept_i] = a_i + a_i^2 + ... + a_i^k_i

with a_i sequence i's chance that a draft is kept (an average over its recent verifications, starting at
one half) and k_i the drafts it would ask for. So speculation runs at any batch size where it pays
(at batch 1 a verifying step costs about a decode step: almost always; at large batches a verifying
step costs more, so only sequences that keep most of their drafts make it worth it), and not where no
verifying graph was captured (an eager verifying step costs far more). Without measured costs (the CPU,
or no CUDA graphs), `auto` speculates while at most `speculative_max_batch` sequences run. Pure Python.
"""

from __future__ import annotations

from bisect import bisect_left

START_ACCEPT = 0.5  # a sequence's draft acceptance before its first verification


def expected_kept(accept: float, drafts: int) -> float:
    """Drafts kept on average out of `drafts`, each kept with probability `accept` while all before it were."""
    return sum(accept**j for j in range(1, drafts + 1))


class StepCosts:
    def __init__(self, costs: dict[tuple[int, int], float]) -> None:
        """costs: milliseconds per step of each (batch bucket, queries per sequence) graph."""
        self.costs = costs
        self.batches = sorted({b for b, q in costs if q > 1})
        self.queries = sorted({q for _, q in costs if q > 1})

    @property
    def max_batch(self) -> int:
        """The largest batch a verifying graph serves (0: none)."""
        return self.batches[-1] if self.batches else 0

    def worth(self, batch: int, expected: float, queries: int) -> bool:
        """Whether a step of `batch` sequences that verifies drafts of up to `queries - 1` per sequence,
        expecting `expected` kept drafts in all, makes more tokens per millisecond than a plain step."""
        i, j = bisect_left(self.batches, batch), bisect_left(self.queries, queries)
        if i == len(self.batches) or j == len(self.queries):
            return False
        bucket = self.batches[i]
        plain, verifying = self.costs.get((bucket, 1)), self.costs.get((bucket, self.queries[j]))
        if plain is None or verifying is None:
            return False
        return (batch + expected) * plain > batch * verifying
