"""When a step should verify drafts: the step costs measured on the device, and what each sequence keeps.

A decode step of B sequences runs the CUDA graph of (B, 1); the same step verifying up to k drafts per
sequence runs the verifying graph of (B, Q), Q the smallest captured query count >= 1 + k, B rounded up
to the graphs' batch bucket. Both are timed at warm-up (DecodeGraphs.measure). A step's drafts are worth
it when the tokens it expects per millisecond beat the plain step's:

    (B + sum_i E[kept_i]) / cost(B, Q)  >  B / cost(B, 1),    E[kept_i] = a_i + a_i^2 + ... + a_i^k_i

where cost(B, Q) is the graph's measured time plus the step's work outside it (staging, block tables,
carry-over, sampling, copies back): that part is learned from the decode steps as they run (a running
average of their device time less their graph's), since it is shared by both kinds of step and can be
most of a small model's step. a_i is sequence i's chance that a draft is kept (an average over its recent verifications, starting at
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
        self.outside: dict[int, float] = {}  # per batch bucket: a step's device time outside its graph
        self.batches = sorted({b for b, q in costs if q > 1})
        self.decode_batches = sorted({b for b, q in costs if q == 1})
        self.queries = sorted({q for _, q in costs if q > 1})

    def observe(self, batch: int, queries: int, ms: float) -> None:
        """A completed step's device time: a decode graph's step updates the time spent outside the graph."""
        graph = self.costs.get((batch, queries))
        if queries == 1 and graph is not None:
            seen = max(0.0, ms - graph)
            last = self.outside.get(batch)
            self.outside[batch] = seen if last is None else 0.9 * last + 0.1 * seen

    @property
    def max_batch(self) -> int:
        """The largest batch a verifying graph serves (0: none)."""
        return self.batches[-1] if self.batches else 0

    def worth(self, batch: int, expected: float, queries: int) -> bool:
        """Whether a step of `batch` sequences that verifies drafts of up to `queries - 1` per sequence,
        expecting `expected` kept drafts in all, makes more tokens per millisecond than a plain step."""
        i, j = bisect_left(self.batches, batch), bisect_left(self.queries, queries)
        d = bisect_left(self.decode_batches, batch)  # a plain step runs the decode graph of its own bucket
        if i == len(self.batches) or j == len(self.queries) or d == len(self.decode_batches):
            return False
        bucket = self.decode_batches[d]
        plain, verifying = self.costs[bucket, 1], self.costs[self.batches[i], self.queries[j]]
        outside = self.outside.get(bucket, 0.0)
        return (batch + expected) * (plain + outside) > batch * (verifying + outside)
