"""How many drafts a step verifies: the step costs measured on the device, and what each sequence keeps.

A decode step of B sequences runs the CUDA graph of (B, B); the same step verifying drafts runs a
verifying graph of (B, T), B rounded up to the graphs' batch bucket and T, its rows, to one of the
bucket's token counts (cuda_graphs.verify_tokens): each sequence brings its newest token and its own
drafts, laid out ragged, so a step costs the tokens it verifies. A step takes the drafts that make the
most tokens per millisecond:

    (B + sum of the chosen drafts' values) / cost(B, T),    the j-th draft of sequence i worth a_i^j

(the chance it is kept: a draft is kept only when all before it were) where the drafts are taken best
first, as many as T leaves room for (so a sequence's are a prefix of its own, and its expected kept
drafts a_i + a_i^2 + ... + a_i^k_i), over the token counts T of the bucket; a verifying step must promise
`MARGIN` (1.1) times the plain step's rate: the estimates below are averages of short histories, and a
step wrongly taken costs every sequence in the batch.

cost(B, T) is what a step of that graph takes: in the overlap loop, which runs the host's work for one
step while the device runs another, the longer of its device time and its host time; without the
overlap, their sum. Device time: a running average of the steps of that graph as they run (the graph
plus what runs outside it: staging, block tables, carry-over, sampling of T rows, copies back); before
one has run, its graph's time at warm-up (DecodeGraphs.measure) plus the time the decode steps of that
bucket spend outside their graph, the part the two kinds of step share. That shared part can be most of
a small model's step, and its sampling grows with T, hence the running averages. Host time: the engine
thread's work for a step of that graph, in three parts each followed as a running average: planning and
launching it (with its rows' masks and masked sampling, and the host tier's restores started after it),
completing it (booking and emitting its tokens; its wait for the device, with the copy of its tokens into
host lists, left out), and handing its outputs over (`deliver`, timed when one step was completed since
the last). The loop's other work in a turn (commands taken in, the stats snapshot) is in no part. Before
a verifying graph's step has run, each part starts from the plain step's of that batch, and no later
reading counts for more than twice the part's estimate (one slow turn, a garbage collection, must not shut
a graph out). With a large model the device's time is the longer and the host's changes nothing; with a
small one at a large batch the host's is, and drafts, which add host work per sequence (lookups,
verification, more tokens to book and emit), are weighed at what they cost. A step that the overlap loop
runs synchronously (a constrained sequence due to draft needs its tokens known) is priced as an
overlapped one: those are rare, and their rows are few.

a_i is sequence i's chance that a draft is kept when all before it were: its verifications' kept
drafts over the drafts they tried (a draft after a rejected one is not tried), averaged over recent
verifications; before its first, or after a miss, the engine's recent acceptance over all sequences
(one half when nothing was verified lately: `Speculator.prior`), halved in a step of several sequences
(the copying sequences hold that acceptance up; `Speculator._draft_caps`); the drafts weighed are those it
found for this step (they are looked up before the step is weighed). So speculation runs at any batch size
where it pays (at batch 1 a verifying step costs about a decode step: almost always; at large batches
the sequences that keep most of their drafts verify, the others decode), and not where no verifying
graph was captured (an eager verifying step costs far more). Without measured costs (the CPU, or no
CUDA graphs), `auto` speculates while at most `speculative_max_batch` sequences run. Pure Python.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

START_ACCEPT = 0.5  # the acceptance prior at start and after a spell without verifications (Speculator.prior)
SMOOTHING = 0.9  # weight of the running average's past in each observed step
MARGIN = 1.1  # a verifying step must promise this many times a plain step's tokens per millisecond
# The parts of a step's host work (observe_host): planning and launching it, completing it, handing its
# outputs over.
LAUNCH, COMPLETE, DELIVER = 0, 1, 2


def observed_accept(kept: int, drafts: int) -> float:
    """One verification's estimate of the chance a tried draft is kept: the drafts up to the first
    rejected one were tried, those after it were not."""
    return kept / (kept + (kept < drafts))


class StepCosts:
    def __init__(self, costs: dict[tuple[int, int], float], max_drafts: int, *, overlap: bool) -> None:
        """costs: milliseconds per step of each (batch bucket, tokens) graph, timed alone (tokens == batch: a
        decode graph). max_drafts: the most drafts a sequence brings to a verifying graph. overlap: the
        host's work for a step runs while the device runs another (the overlap loop)."""
        self.costs = costs
        self.max_drafts = max_drafts
        self.overlap = overlap
        self.margin = MARGIN
        self.outside: dict[int, float] = {}  # per decode bucket: its steps' device time outside the graph
        self.seen: dict[tuple[int, int], float] = {}  # per graph: its steps' whole device time
        # Per part of the host's work (LAUNCH, COMPLETE, DELIVER), per graph: its running average, ms.
        self.host: tuple[dict[tuple[int, int], float], ...] = ({}, {}, {})
        self.tokens: dict[int, list[int]] = {}  # per verifying bucket: its graphs' token counts
        for b, t in sorted(costs):
            if t > b:
                self.tokens.setdefault(b, []).append(t)
        self.batches = sorted(self.tokens)
        self.decode_batches = sorted({b for b, t in costs if t == b})

    def observe(self, batch: int, tokens: int, ms: float) -> None:
        """A completed step's whole device time, on the graph of (batch, tokens)."""
        graph = self.costs.get((batch, tokens))
        if graph is None:
            return
        last = self.seen.get((batch, tokens))
        if last is None and tokens > batch:  # from the estimate: one unlucky first step must not shut a graph out
            last = graph + self.outside.get(batch, 0.0)
        self.seen[batch, tokens] = ms if last is None else SMOOTHING * last + (1 - SMOOTHING) * ms
        if tokens == batch:
            self.outside[batch] = max(0.0, self.seen[batch, tokens] - graph)

    def observe_host(self, batch: int, tokens: int, part: int, ms: float) -> None:
        """The engine thread's work on `part` (LAUNCH, COMPLETE, DELIVER) of a step on the graph of
        (batch, tokens), its waits for the device left out."""
        if (batch, tokens) not in self.costs:
            return
        table = self.host[part]
        last = table.get((batch, tokens))
        if last is None and tokens > batch:
            last = self._plain_host(batch, part)
        if last is None:
            table[batch, tokens] = ms
        else:
            table[batch, tokens] = SMOOTHING * last + (1 - SMOOTHING) * min(ms, 2 * last)

    def _plain_host(self, batch: int, part: int) -> float | None:
        plain = self.plain_bucket(batch)
        return None if plain is None else self.host[part].get((plain, plain))

    def cost(self, bucket: int, tokens: int, decode_bucket: int) -> float:
        """A step's time on the graph of (bucket, tokens): its device time (as observed, else as timed alone
        plus the time outside the graph that the decode steps of decode_bucket showed) and its host time
        (each part as observed, else the plain step's of decode_bucket; 0 before any), the longer of the two
        in the overlap loop, else their sum."""
        seen = self.seen.get((bucket, tokens))
        device = seen if seen is not None else self.costs[bucket, tokens] + self.outside.get(decode_bucket, 0.0)
        host = 0.0
        for table in self.host:
            ms = table.get((bucket, tokens))
            host += ms if ms is not None else table.get((decode_bucket, decode_bucket), 0.0)
        return max(device, host) if self.overlap else device + host

    def plain_bucket(self, batch: int) -> int | None:
        """The decode graph's bucket a plain step of `batch` sequences runs in (None: none that large)."""
        d = bisect_left(self.decode_batches, batch)
        return self.decode_batches[d] if d < len(self.decode_batches) else None

    @property
    def max_batch(self) -> int:
        """The largest batch a verifying graph serves (0: none)."""
        return self.batches[-1] if self.batches else 0

    def plan_drafts(self, batch: int, drafting: list[tuple[float, int, float]]) -> list[int]:
        """How many of its drafts each sequence verifies in a decode step of `batch` sequences, for the most
        tokens per millisecond (all 0: a plain step). drafting: (acceptance, drafts found, the chance they
        follow the real tokens) of each sequence that found drafts for the step."""
        counts = [0] * len(drafting)
        i, plain = bisect_left(self.batches, batch), self.plain_bucket(batch)
        if i == len(self.batches) or plain is None:
            return counts
        bucket = self.batches[i]
        # Every draft's value, best first; a sequence's j-th is worth less than its (j-1)-th (ties: j first).
        values = sorted(
            (
                (chance * accept**j, j, n)
                for n, (accept, found, chance) in enumerate(drafting)
                if accept * chance > 0.0
                for j in range(1, min(found, self.max_drafts) + 1)
            ),
            key=lambda v: (-v[0], v[1]),
        )
        kept = list(accumulate((v[0] for v in values), initial=0.0))
        best, best_rate = 0, self.margin * batch / self.cost(plain, plain, plain)
        for tokens in self.tokens[bucket]:
            taken = min(len(values), tokens - batch)
            rate = (batch + kept[taken]) / self.cost(bucket, tokens, plain)
            if rate > best_rate:
                best, best_rate = taken, rate
            if taken == len(values):  # a larger graph adds cost and no draft
                break
        for _, _, n in values[:best]:
            counts[n] += 1
        return counts
