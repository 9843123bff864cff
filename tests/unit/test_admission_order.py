"""The order one step considers waiting sequences in (engine/sched/order.py): within a class and tenant, turns that
bring their KV (GPU blocks, or a host-tier copy, with at most WARM_TOKENS left to compute) before sequences that
bring none, until those have waited the bound; between tenants, the same picks as queue order would make."""

from __future__ import annotations

from cbd.engine.kv.host_pool import HostCopy
from cbd.engine.sampling_params import PRIORITY_INTERACTIVE, SamplingParams
from cbd.engine.sched.order import WARM_TOKENS, AdmissionOrder, brings_kv
from cbd.engine.sequence import Request, Sequence


def _seq(i: int, tokens: int, tenant: str = "", queued_at: float = 0.0, gpu: int = 0, host: int = 0) -> Sequence:
    """A waiting sequence of `tokens` tokens; gpu: tokens whose KV it holds in GPU blocks; host: in a host copy."""
    params = SamplingParams(max_tokens=4)
    request = Request(
        f"r{i}", [1] * tokens, params, 0, tenant=tenant, priority=PRIORITY_INTERACTIVE, queued_at=queued_at
    )
    seq = Sequence(i, request, 0, [1] * tokens, tokens)
    if gpu:
        seq.block_table, seq.num_computed_tokens = list(range(-(-gpu // 16))), gpu
    if host:
        seq.host_prefix = HostCopy(list(range(-(-host // 16))), host)
    return seq


def _order(waiting: list[Sequence], now: float = 1.0, bound: float = 10.0) -> list[int]:
    order = AdmissionOrder(waiting, [], now, aging_seconds=30.0, warm_first_seconds=bound)
    picked = []
    while (seq := order.next()) is not None:
        order.take(seq)
        picked.append(seq.seq_id)
    return picked


def test_what_brings_its_kv() -> None:
    assert brings_kv(_seq(0, 900, gpu=800)) and brings_kv(_seq(0, 900, host=800))
    assert not brings_kv(_seq(0, 900))  # nothing held (prefix-cache hits are found only at admission)
    assert brings_kv(_seq(0, 100 + WARM_TOKENS, host=100))  # at most WARM_TOKENS left
    assert not brings_kv(_seq(0, 101 + WARM_TOKENS, gpu=100))


def test_turns_that_bring_their_kv_go_first_until_the_others_waited_the_bound() -> None:
    waiting = [_seq(0, 5000), _seq(1, 5000, gpu=4900), _seq(2, 5000), _seq(3, 5000, host=4800)]
    assert _order(waiting) == [1, 3, 0, 2]  # each part in queue order
    assert _order(waiting, bound=0.0) == [0, 1, 2, 3]  # 0: queue order
    assert _order(waiting, now=10.0) == [0, 1, 2, 3]  # every prompt has waited the bound
    late = [_seq(0, 5000), _seq(1, 5000, gpu=4900), _seq(2, 5000, queued_at=5.0), _seq(3, 5000, host=4800)]
    assert _order(late, now=10.0) == [0, 1, 3, 2]  # only the prompt that waited 10 s keeps its place


def test_tenants_are_picked_as_queue_order_would_pick_them() -> None:
    """Tenant a: prompts at places 0 and 1 and a turn bringing its KV at 3; tenant b: a prompt at 2. No seats run,
    so tenants alternate by the place their next sequence holds: a's places 0, 1, 3 go to its turn first, then
    its prompts; b's prompt keeps place 2."""
    waiting = [_seq(0, 5000, "a"), _seq(1, 5000, "a"), _seq(2, 5000, "b"), _seq(3, 5000, "a", gpu=4900)]
    assert _order(waiting, bound=0.0) == [0, 2, 1, 3]  # fewest seats first: a, b, then a, a
    assert _order(waiting) == [3, 2, 0, 1]  # a's first place taken by its turn; b as before
