"""How many drafts a step verifies: the step costs measured on the device, and what each sequence keeps.

A decode step of B sequences runs the CUDA graph of (B, 1); the same step verifying up to Q - 1 drafts
per sequence runs the verifying graph of (B, Q), Q one of the captured query counts, B rounded up to
the graphs' batch bucket. A step takes the Q (1: no drafts) that makes the most tokens per millisecond:

    (B + sum_i E[kept_i]) / cost(B, Q),    E[kept_i] = a_i + a_i^2 + ... + a_i^min(k_i, Q - 1)

where a verifying step must promise `MARGIN` (1.1) times the plain step's rate: the estimates below
are averages of short histories, and a step wrongly taken costs every sequence in the batch.

cost(B, Q) is the step's whole device time: a running average of the steps of that graph as they run
(the graph plus what runs outside it: staging, block tables, carry-over, sampling of B x Q rows, copies
back); before one has run, its graph's time at warm-up (DecodeGraphs.measure) plus the time the decode
steps of that bucket spend outside their graph, the part the two kinds of step share. That shared part
can be most of a small model's step, and its sampling grows with Q, hence the running averages.

a_i is sequence i's chance that a draft is kept when all before it were: its verifications' kept
drafts over the drafts they tried (a draft after a rejected one is not tried), averaged over recent
verifications; before its first, or after a miss, the engine's recent acceptance over all sequences
(one half when nothing was verified lately: `Speculator.prior`); k_i the drafts it found (the sum runs
over the sequences that found drafts for this step: they are looked up before the step is weighed). So speculation runs at any batch
size where it pays (at batch 1 a verifying step costs about a decode step: almost always; at large
batches a verifying step costs more, so only sequences that keep most of their drafts make it worth
it, and with fewer drafts when the cheaper graph pays more), and not where no verifying graph was
captured (an eager verifying step costs far more). Without measured costs (the CPU, or no CUDA
graphs), `auto` speculates while at most `speculative_max_batch` sequences run. Pure Python.
"""

from __future__ import annotations

from bisect import bisect_left

START_ACCEPT = 0.5  # the acceptance prior at start and after a spell without verifications (Speculator.prior)
SMOOTHING = 0.9  # weight of the running average's past in each observed step
MARGIN = 1.1  # a verifying step must promise this many times a plain step's tokens per millisecond


def expected_kept(accept: float, drafts: int) -> float:
    """Drafts kept on average out of `drafts`, each kept with probability `accept` while all before it were:
    accept + accept^2 + ... + accept^drafts."""
    if accept >= 1.0:
        return float(drafts)
    return accept * (1.0 - accept**drafts) / (1.0 - accept)


def observed_accept(kept: int, drafts: int) -> float:
    """One verification's estimate of the chance a tried draft is kept: the drafts up to the first
    rejected one were tried, those after it were not."""
    return kept / (kept + (kept < drafts))


class StepCosts:
    def __init__(self, costs: dict[tuple[int, int], float]) -> None:
        """costs: milliseconds per step of each (batch bucket, queries per sequence) graph, timed alone."""
        self.costs = costs
        self.outside: dict[int, float] = {}  # per decode bucket: its steps' device time outside the graph
        self.seen: dict[tuple[int, int], float] = {}  # per graph: its steps' whole device time
        self.batches = sorted({b for b, q in costs if q > 1})
        self.decode_batches = sorted({b for b, q in costs if q == 1})
        self.queries = sorted({q for _, q in costs if q > 1})

    def observe(self, batch: int, queries: int, ms: float) -> None:
        """A completed step's whole device time, on the graph of (batch, queries)."""
        graph = self.costs.get((batch, queries))
        if graph is None:
            return
        last = self.seen.get((batch, queries))
        if last is None and queries > 1:  # from the estimate: one unlucky first step must not shut a graph out
            last = graph + self.outside.get(batch, 0.0)
        self.seen[batch, queries] = ms if last is None else SMOOTHING * last + (1 - SMOOTHING) * ms
        if queries == 1:
            self.outside[batch] = max(0.0, self.seen[batch, queries] - graph)

    def cost(self, bucket: int, queries: int, decode_bucket: int) -> float:
        """A step's device time on the graph of (bucket, queries): as observed, else as timed alone plus the
        time outside the graph that the decode steps of decode_bucket showed."""
        seen = self.seen.get((bucket, queries))
        if seen is not None:
            return seen
        return self.costs[bucket, queries] + self.outside.get(decode_bucket, 0.0)

    @property
    def max_batch(self) -> int:
        """The largest batch a verifying graph serves (0: none)."""
        return self.batches[-1] if self.batches else 0

    def best_queries(self, batch: int, drafting: list[tuple[float, int]]) -> int:
        """The query count per sequence for a decode step of `batch` sequences that makes the most tokens per
        millisecond: 1 (no drafts) or a verifying graph's. drafting: (acceptance, drafts found) of each
        sequence that found drafts for the step; with Q queries it verifies at most Q - 1."""
        i, d = bisect_left(self.batches, batch), bisect_left(self.decode_batches, batch)
        most = max((k for _, k in drafting), default=0)
        if i == len(self.batches) or d == len(self.decode_batches) or most == 0:
            return 1
        bucket, plain = self.batches[i], self.decode_batches[d]
        best, best_rate = 1, MARGIN * batch / self.cost(plain, 1, plain)
        for queries in self.queries:
            expected = sum(expected_kept(accept, min(k, queries - 1)) for accept, k in drafting)
            rate = (batch + expected) / self.cost(bucket, queries, plain)
            if rate > best_rate:
                best, best_rate = queries, rate
            if queries > most:  # a larger graph adds cost and no draft
                break
        return best
