"""A step's inputs: packed on the CPU into one int64 and one float32 array, staged through two buffers.

Packing (`pack_step`): the plan's chunks and sample rows become the runner's typed `StepBatch`:
every per-token, per-sequence and per-row array of the step goes into one flat int64 array (and the
float sampling parameters into one float32 array), so a step costs two host-to-device copies
whatever its shape, plus `StepMeta`, the host-side facts the runner needs (no requests). Staging
slices the device copy back into the typed `StepTensors`.

Carry-over: a chunk whose first token is still being sampled by the step in flight has input id 0
there; `carry_dst` / `carry_src` tell the runner to fill it on the device from that step's sampled
tokens, so step N+1 needs nothing from step N's host side. After drafts in flight, the token's row and
the chunk's positions depend on how many that step keeps: `carry_group` / `seq_group` / `row_group`
name its verifying group, and `verify_ids` / `verify_rows` / `verify_k` / `verify_seq` let a verifying step
count what it keeps on the device (device/draft_carry.py); `redraft` marks the groups whose drafts the
device looks up again, and `token_index` / `token_values` are the known tokens its token table lacks
(device/draft_lookup.py, device/token_rows.py).

Double buffering: step N+1 is staged into the buffer pair that step N is *not* reading. Before
the host overwrites a pinned buffer it waits for that buffer's previous copy (`h2d_done`); before
the copy overwrites the device buffer, the h2d stream waits until compute has finished reading it
(`consumed`). On CPU the device buffer is the host buffer and the events are None.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cbd.engine.device.block_tables import PADDING_ROW, BlockTableRows
from cbd.engine.device.streams import DeviceStreams
from cbd.engine.device.token_rows import TokenRows
from cbd.engine.sched.plan import StepPlan


@dataclass(slots=True)
class PackedStep:
    """Host-side packing of one step; `add` appends a named int64 array, `add_float` a float32 one. The
    arrays are `array.array`s: built from lists in C and staged as one buffer (no per-element conversion)."""

    ints: array = field(default_factory=lambda: array("q"))
    floats: array = field(default_factory=lambda: array("f"))
    int_fields: dict[str, tuple[int, int]] = field(default_factory=dict)
    float_fields: dict[str, tuple[int, int]] = field(default_factory=dict)

    def add(self, name: str, values: list[int]) -> None:
        if len(self.ints) % 2:
            self.ints.append(0)  # 16-byte aligned views: kernels see one alignment, so compile once
        self.int_fields[name] = (len(self.ints), len(values))
        self.ints.fromlist(values)

    def add_float(self, name: str, values: list[float]) -> None:
        self.floats.fromlist([0.0] * (-len(self.floats) % 4))
        self.float_fields[name] = (len(self.floats), len(values))
        self.floats.fromlist(values)


@dataclass(slots=True)
class StepMeta:
    """Host-side facts of one packed step (picklable: tensor-parallel ranks receive it)."""

    num_seqs: int  # scheduled sequences (chunks)
    batch: int  # rows of the forward: num_seqs, or the CUDA-graph bucket it is padded to
    width: int  # block-table columns the step reads
    graph: bool  # run the captured graph of (`batch`, `graph_tokens`)
    decode_only: bool  # one new token per sequence, one sample row per sequence
    max_query_len: int
    max_context_len: int
    num_rows: int  # sample rows (forks included)
    any_random: bool  # some row samples (else every row is greedy: no parameter arrays are packed)
    any_top_k_or_p: bool
    any_min_p: bool
    max_logprobs: int | None  # None: no row wants logprobs
    graph_tokens: int = 0  # a graph's rows: `batch` for a decode graph, more for a verifying one (padded)
    num_decodes: int = 0  # leading sequences with one new token each (running decodes come first)
    # Some row samples under a grammar: launch runs the forward only, and the sampling waits for the rows'
    # token masks (runner.sample_masked; engine/device/token_masks.py). Without one, launch samples at once.
    masked: bool = False
    table_shape: tuple[int, int] = (0, 0)  # the device block table's rows and columns (block_tables.py)
    token_rows: int = 0  # rows of the device's token table (token_rows.py); 0: drafts are the host's only
    drafts: bool = False  # some sequence verifies drafts (samples several rows)


@dataclass(slots=True)
class StepBatch:
    """Everything the runner needs for one step; it knows no requests."""

    packed: PackedStep
    meta: StepMeta
    block_copies: list[tuple[int, int]]  # (src, dst) KV block copies before the forward


@dataclass(slots=True)
class StepTensors:
    """Device views of one packed step. Shapes: T new tokens, B sequences (padded to `batch`), R rows."""

    ids: torch.Tensor  # [T] int64 input ids (0 where carried over)
    qstart: torch.Tensor  # [B + 1] int64 packed row where each sequence's tokens start (a graph's padding: none)
    ctx: torch.Tensor  # [batch] int64 context length after this step
    logits_rows: torch.Tensor  # [S] int64 rows whose logits are sampled: one per sampled token (a
    # verifying chunk samples each of its 1 + k)
    table_rows: torch.Tensor  # [batch] int64 the row of the device's block table each sequence reads (block_tables.py)
    table_index: torch.Tensor | None = None  # [U] int64 flat positions in that table written before the step
    table_values: torch.Tensor | None = None  # [U] int64 the block ids written there
    row_logits: torch.Tensor | None = None  # [R] index into logits_rows per sample row (forks repeat one)
    carry_dst: torch.Tensor | None = None  # [C] positions in ids filled from the previous step's tokens
    carry_src: torch.Tensor | None = None  # [C] rows of the previous step's sampled tokens
    # Chunks after drafts in flight (1 + the previous step's verifying group; 0: none), see draft_carry.py:
    carry_group: torch.Tensor | None = None  # [C] per carried-over token
    seq_group: torch.Tensor | None = None  # [batch] per sequence
    row_group: torch.Tensor | None = None  # [R] per sample row (only when a row samples at random)
    # A step verifying drafts, G groups of at most D drafts (padded): where each draft is in ids, the
    # sample row before it, and each group's number of drafts.
    verify_ids: torch.Tensor | None = None  # [G * D]
    verify_rows: torch.Tensor | None = None  # [G * D]
    verify_k: torch.Tensor | None = None  # [G]
    verify_seq: torch.Tensor | None = None  # [G] each group's sequence (its index in the step)
    # Drafts looked up on the device (device/draft_lookup.py): per group 1 where the device drafts (only when
    # some group does), and the host's writes into the token table (flat positions, token ids).
    redraft: torch.Tensor | None = None  # [G]
    token_index: torch.Tensor | None = None  # [W]
    token_values: torch.Tensor | None = None  # [W]
    seed: torch.Tensor | None = None  # the rest: per row, only when a row samples at random
    stream: torch.Tensor | None = None
    position: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None


@dataclass(slots=True)
class StagedStep:
    """Device views of one packed step, and the buffer slot that holds them."""

    tensors: StepTensors
    slot: _Slot


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
            slot.host_i[:n_i] = torch.frombuffer(packed.ints, dtype=torch.int64)
        if n_f:
            slot.host_f[:n_f] = torch.frombuffer(packed.floats, dtype=torch.float32)
        if s.cuda:
            with s.on(s.h2d):
                s.wait(s.h2d, slot.consumed)  # step N-1 (same slot) has finished reading the device copy
                if n_i:
                    slot.dev_i[:n_i].copy_(slot.host_i[:n_i], non_blocking=True)
                if n_f:
                    slot.dev_f[:n_f].copy_(slot.host_f[:n_f], non_blocking=True)
                s.record(slot.h2d_done, s.h2d)
        views = {name: slot.dev_i[o : o + n] for name, (o, n) in packed.int_fields.items()}
        views.update({name: slot.dev_f[o : o + n] for name, (o, n) in packed.float_fields.items()})
        return StagedStep(StepTensors(**views), slot)

    def release(self, staged: StagedStep) -> None:
        """Called on the compute stream after the step's last read of its staged tensors."""
        self.streams.record(staged.slot.consumed, self.streams.compute)


@dataclass(slots=True)
class _ChunkArrays:
    """The per-token and per-sequence arrays of a step's chunks (before padding), as pack_step reads them."""

    ids: list[int]
    qstart: list[int]
    ctx: list[int]
    query_lens: list[int]
    logits_rows: list[int]
    carry_dst: list[int]
    carry_src: list[int]
    after: list[tuple[int, int, int]]  # chunks after drafts in flight: (chunk, carry index, group + 1)
    drafted: list[tuple[int, int, int]]  # chunks with drafts: (index of the first draft in ids, drafts, chunk)
    width: int  # the widest block table


def gather_chunks(plan: StepPlan) -> _ChunkArrays:
    """Any step's chunks, one at a time."""
    ids: list[int] = []
    qstart: list[int] = [0]
    ctx: list[int] = []
    query_lens: list[int] = []
    logits_rows: list[int] = []
    carry_dst: list[int] = []
    carry_src: list[int] = []
    after: list[tuple[int, int, int]] = []
    drafted: list[tuple[int, int, int]] = []
    width = 1
    for chunk in plan.chunks:
        seq, start, n = chunk.seq, chunk.start, chunk.num_new_tokens
        first = len(ids)
        if n == 1:
            ids.append(seq.token_ids[start])
        else:
            ids += seq.token_ids[start : start + n]
        if chunk.carry_row >= 0:  # only its first token can be in flight (then its drafts, if any)
            if chunk.carry_group >= 0:
                after.append((len(ctx), len(carry_dst), chunk.carry_group + 1))
            carry_dst.append(first)
            carry_src.append(chunk.carry_row)
            ids[first] = 0
        if chunk.samples:  # its last token's logits; with drafts, those of the tokens before each draft too
            if chunk.num_draft:
                logits_rows += range(len(ids) - 1 - chunk.num_draft, len(ids))
                drafted.append((first + 1, chunk.num_draft, len(ctx)))
            else:
                logits_rows.append(len(ids) - 1)
        qstart.append(len(ids))
        ctx.append(start + n)
        query_lens.append(n)
        width = max(width, len(seq.block_table))
    return _ChunkArrays(ids, qstart, ctx, query_lens, logits_rows, carry_dst, carry_src, after, drafted, width)


def is_plain_decode(plan: StepPlan) -> bool:
    """Every chunk one new token, sampled once, without drafts or forks, none after drafts in flight: what
    `gather_decodes` packs (most steps of a running batch)."""
    return len(plan.samples) == len(plan.chunks) and all(
        c.num_new_tokens == 1 and c.samples and not c.num_draft and c.carry_group < 0 for c in plan.chunks
    )


def gather_decodes(plan: StepPlan) -> _ChunkArrays:
    """A plain decode step's chunks (is_plain_decode), as gather_chunks makes them, a list at a time."""
    chunks = plan.chunks
    num_seqs = len(chunks)
    ids = [0 if c.carry_row >= 0 else c.seq.token_ids[c.start] for c in chunks]
    carried = [i for i, c in enumerate(chunks) if c.carry_row >= 0]
    return _ChunkArrays(
        ids=ids, qstart=list(range(num_seqs + 1)), ctx=[c.start + 1 for c in chunks], query_lens=[1] * num_seqs,
        logits_rows=list(range(num_seqs)), carry_dst=carried, carry_src=[chunks[i].carry_row for i in carried],
        after=[], drafted=[], width=max(1, max(len(c.seq.block_table) for c in chunks)),
    )  # fmt: skip


def pack_step(
    plan: StepPlan,
    graph_bucket: Callable[[int, int, int], tuple[int, int] | None],
    tables: BlockTableRows,
    tokens: TokenRows | None = None,
) -> StepBatch:
    """Pack a planned step. Reads only what the plan recorded when it was made (chunk starts, carry
    rows, sample rows), and the sequences' block tables (the scheduler has already advanced the sequences
    past the plan; their tables cover it). tables: the device block table's rows (block_tables.py).
    graph_bucket(num_seqs, num_tokens, max_query_len): the captured graph (batch, tokens) for a step whose
    every sequence samples after each of its new tokens (a decode step, or one verifying drafts), or None.
    A graph's step is packed padded: sequences with no tokens up to `batch` (a decode graph: one token each,
    on the scratch block), then rows up to `tokens`. tokens: the device's token table's rows (token_rows.py),
    when the device drafts for the verifying groups whose newest token is in flight (None: it never does)."""
    rows = plan.samples
    num_seqs = len(plan.chunks)
    if is_plain_decode(plan):
        a = gather_decodes(plan)
        num_tokens, max_query_len, num_decodes = num_seqs, 1, num_seqs
        uniform = True
    else:
        a = gather_chunks(plan)
        num_tokens = len(a.ids)
        max_query_len = max(a.query_lens)
        num_decodes = next((i for i, n in enumerate(a.query_lens) if n != 1), num_seqs)
        # Every token sampled from (its own logits row, no forks): a decode step, or drafts being verified.
        uniform = len(rows) == num_tokens and all(
            c.samples and c.num_new_tokens == c.num_draft + 1 for c in plan.chunks
        )
    decode_only = uniform and max_query_len == 1
    graph = graph_bucket(num_seqs, num_tokens, max_query_len) if uniform else None
    batch, graph_tokens = graph if graph is not None else (num_seqs, 0)
    ids, qstart, ctx, carry_dst, after = a.ids, a.qstart, a.ctx, a.carry_dst, a.after
    max_context_len = max(ctx)
    table_index: list[int] = []
    table_values: list[int] = []
    table_rows = tables.sync([c.seq for c in plan.chunks], table_index, table_values)
    if graph is not None:  # pad to the bucket: sequences that touch only the scratch block
        pad = batch - num_seqs
        ctx += [1] * pad
        if graph_tokens > batch:  # a verifying graph's: no tokens, then padding rows up to its token count
            qstart += [len(ids)] * pad
        ids += [0] * (graph_tokens - len(ids))
        table_rows += [PADDING_ROW] * pad
    packed = PackedStep()
    packed.add("ids", ids)
    packed.add("qstart", qstart)
    packed.add("ctx", ctx)
    packed.add("logits_rows", a.logits_rows)
    if len(rows) != len(a.logits_rows):  # forks: several rows read one logits row (rows come grouped by source)
        row_logits, k, source, position = [], -1, None, -1
        for r in rows:
            if r.source is not source or r.position != position:  # a fork repeats its parent's position
                k, source, position = k + 1, r.source, r.position
            row_logits.append(k)
        packed.add("row_logits", row_logits)
    if carry_dst:
        packed.add("carry_dst", carry_dst)
        packed.add("carry_src", a.carry_src)
    if after:  # see draft_carry.py
        carry_group, seq_group = [0] * len(carry_dst), [0] * batch
        for index, carried, group in after:
            carry_group[carried] = seq_group[index] = group
        packed.add("carry_group", carry_group)
        packed.add("seq_group", seq_group)
    if a.drafted:
        _pack_verify(packed, a.drafted, rows)
        if tokens is not None:
            _pack_device_drafts(packed, plan, a.drafted, table_rows, tokens)
    packed.add("table_rows", table_rows)
    if table_index:
        packed.add("table_index", table_index)
        packed.add("table_values", table_values)
    params = [r.source.request.params for r in rows]
    any_random = any(not p.greedy for p in params)
    if any_random:
        packed.add("seed", [r.source.request.seed for r in rows])
        packed.add("stream", [r.target.candidate_index for r in rows])
        packed.add("position", [r.position for r in rows])
        if after:
            groups = {plan.chunks[index].seq.seq_id: group for index, _, group in after}
            packed.add("row_group", [groups.get(r.target.seq_id, 0) for r in rows])
        packed.add("top_k", [p.top_k for p in params])
        packed.add_float("temperature", [p.temperature for p in params])
        packed.add_float("top_p", [p.top_p for p in params])
        packed.add_float("min_p", [p.min_p for p in params])
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    meta = StepMeta(
        num_seqs=num_seqs, batch=batch, width=a.width, graph=graph is not None, decode_only=decode_only,
        max_query_len=max_query_len, max_context_len=max_context_len, num_rows=len(rows), any_random=any_random,
        any_top_k_or_p=any_random and any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params),
        any_min_p=any_random and any(not p.greedy and p.min_p > 0.0 for p in params),
        max_logprobs=max(wanted) if wanted else None, graph_tokens=graph_tokens,
        num_decodes=num_decodes,
        masked=plan.constrained, table_shape=(tables.num_rows, tables.num_columns),
        token_rows=tokens.num_rows if tokens is not None else 0, drafts=bool(a.drafted),
    )  # fmt: skip
    return StepBatch(packed, meta, plan.block_copies)


def _pack_verify(packed: PackedStep, drafted: list[tuple[int, int, int]], rows: list) -> None:
    """A verifying step's groups, padded to the most drafts: where each draft is in ids, the sample row
    before it (a group's rows start at its first row, in chunk order), each group's drafts and sequence."""
    most = max(k for _, k, _ in drafted)
    bases = [i for i, r in enumerate(rows) if r.num_draft]
    ids: list[int] = []
    sampled: list[int] = []
    for (first, k, _), base in zip(drafted, bases, strict=True):
        ids += [*range(first, first + k), *([0] * (most - k))]
        sampled += [*range(base, base + k), *([0] * (most - k))]
    packed.add("verify_ids", ids)
    packed.add("verify_rows", sampled)
    packed.add("verify_k", [k for _, k, _ in drafted])
    packed.add("verify_seq", [chunk for _, _, chunk in drafted])


def _pack_device_drafts(
    packed: PackedStep, plan: StepPlan, drafted: list[tuple[int, int, int]], table_rows: list[int], tokens: TokenRows
) -> None:
    """The groups the device drafts for (device/draft_lookup.py): those whose newest token is in flight, without
    a grammar (a constrained sequence's drafts were checked by its grammar), and their rows' known tokens."""
    redraft = []
    index: list[int] = []
    values: list[int] = []
    for _, _, i in drafted:
        chunk = plan.chunks[i]
        device = chunk.carry_row >= 0 and chunk.seq.grammar is None
        redraft.append(int(device))
        if device:
            tokens.sync(table_rows[i], chunk.seq, index, values)
        else:
            tokens.written(table_rows[i], chunk.seq)
    if any(redraft):
        packed.add("redraft", redraft)
    if index:
        packed.add("token_index", index)
        packed.add("token_values", values)
