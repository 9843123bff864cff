"""CUDA checks, run on the accelerator machine (skipped where no GPU is present)."""

from __future__ import annotations

import random

import pytest
import torch

from cbd.engine.sampling_params import SamplingParams
from cbd.model.loader import load_model
from helpers import assert_greedy_matches, make_core, record_last_layer_rows, run_all

pytestmark = pytest.mark.gpu


def _prompts(count: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 256) for _ in range(rng.randrange(4, 60))] for _ in range(count)]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral-window"])
def test_fp32_on_cuda_matches_transformers_on_cuda(tiny_checkpoint, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    directory = tiny_checkpoint(kind)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).cuda().eval()
    core = make_core(load_model(str(directory), device="cuda"), block_size=8, max_num_batched_tokens=96)
    prompts = _prompts(8)
    results = run_all(core, prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        ours = result["tokens"][0]
        theirs = _hf_cuda(hf, prompt, 24)
        assert_greedy_matches(core, _CpuView(hf), prompt, ours, theirs)


@pytest.mark.parametrize("kind", ["llama", "mistral-window"])
def test_long_chunks_last_layer_on_sampled_rows_matches_transformers_on_cuda(
    tiny_checkpoint, kind: str, monkeypatch
) -> None:
    """Prompts of 290-450 tokens in chunks of 300 beside others' last chunks and decodes: steps whose last layer
    runs past its K/V on the sampled rows alone (runner.LAST_LAYER_MIN_SKIPPED), Triton's kernels, fp32."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    directory = tiny_checkpoint(kind)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).cuda().eval()
    core = make_core(load_model(str(directory), device="cuda"), block_size=8, max_num_batched_tokens=300)
    seen = record_last_layer_rows(monkeypatch)  # the sampled rows of each step whose last layer skipped the rest
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (450, 380, 290, 20)]
    results = run_all(core, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert_greedy_matches(core, _CpuView(hf), prompt, result["tokens"][0], _hf_cuda(hf, prompt, 12))
    assert 0 in seen and any(n > 1 for n in seen), seen


def _hf_cuda(hf, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


class _CpuView:
    """Lets helpers.hf_top2_gap feed CPU tensors to a CUDA model."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, ids: torch.Tensor):
        return self.model(ids.cuda())


def test_seeded_sampling_is_identical_on_cpu_and_cuda(tiny_checkpoint) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    directory = str(tiny_checkpoint("llama"))
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=11, n=3, ignore_eos=True)
    prompt = _prompts(1)[0]
    cpu = run_all(make_core(load_model(directory)), [prompt], params)[0]["tokens"]
    gpu = run_all(make_core(load_model(directory, device="cuda")), [prompt], params)[0]["tokens"]
    assert cpu == gpu


def test_bf16_on_cuda_runs_a_mixed_batch_and_frees_everything(tiny_checkpoint) -> None:
    loaded = load_model(str(tiny_checkpoint("qwen2")), device="cuda", dtype=torch.bfloat16)
    core = make_core(loaded, num_kv_blocks=24, block_size=4)  # small pool: forces preemption
    prompts = _prompts(10)
    params = [
        SamplingParams(max_tokens=30, temperature=0.0 if i % 2 else 0.7, seed=i, n=1 + i % 3, ignore_eos=True)
        for i in range(10)
    ]
    results = run_all(core, prompts, params)
    assert all(
        len(r["tokens"]) == p.n and all(len(t) == 30 for t in r["tokens"].values()) for r, p in zip(results, params)
    )
    assert core.scheduler.num_preemptions > 0 and core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_decode_graph_replay_equals_eager_forward(tiny_checkpoint, kv_cache_dtype: str) -> None:
    """Same static inputs, same batch: replaying the captured graph gives the eager forward's logits bit for bit."""
    core = make_core(
        load_model(str(tiny_checkpoint("llama")), device="cuda", dtype=torch.bfloat16), block_size=16,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    core.warm_up()
    graphs = core.runner.graphs
    assert graphs is not None and graphs.graphs
    torch.manual_seed(0)
    rng = random.Random(0)
    decodes = [graphs.bucket(batch, batch, 1) for batch in (1, 8, 24)]
    verifying = [graphs.bucket(3, tokens, most) for tokens, most in ((5, 3), (10, 5), (27, 9))]
    assert all(shape is not None for shape in decodes + verifying)
    assert [shape[1] for shape in verifying] == [6, 12, 36]  # type: ignore[index]  # bucket 4: 4 + 2, 8, 32
    for bucket, tokens in decodes + verifying:  # type: ignore[misc]
        graphs.ids[:tokens] = torch.randint(0, 256, (tokens,), device="cuda")
        if tokens > bucket:  # ragged: 1 to 9 tokens a sequence, the last sequence none, then padding rows
            lens = [rng.randint(1, graphs.max_queries) for _ in range(bucket - 1)] + [0]
            while sum(lens) > tokens - 1:
                lens[lens.index(max(lens))] -= 1
            starts = torch.tensor([0, *lens], device="cuda").cumsum(0)
            graphs.query_start[: bucket + 1] = starts
            lens_t = starts[1:] - starts[:-1]
        else:
            lens_t = torch.ones(bucket, dtype=torch.int64, device="cuda")
        graphs.context_lens[:bucket] = lens_t.clamp(min=1) + torch.randint(0, 60, (bucket,), device="cuda")
        graphs.block_tables[:bucket, :5] = torch.randperm(200, device="cuda")[: bucket * 5].view(bucket, 5)
        graph, logits = graphs.graphs[bucket, tokens]
        with torch.inference_mode():
            with torch.cuda.stream(graphs.stream):
                graph.replay()
                replayed = logits.clone()
                eager = graphs.forward(bucket, tokens)
            torch.cuda.synchronize()
        real = int(graphs.query_start[bucket]) if tokens > bucket else bucket  # padding rows' logits are undefined
        assert torch.equal(replayed[:real], eager[:real]), (bucket, tokens)


class _OracleDrafter:
    """Drafts the reference run's next tokens, with every third proposal wrong from its third token on:
    runs kept whole, runs cut short, at every draft length the scheduler asks for."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.reference = reference
        self.calls = 0

    def propose(self, seq, k: int, end: int | None = None) -> list[int]:
        end = seq.num_tokens if end is None else end  # the overlap loop: tokens from end on are in flight
        future = self.reference[tuple(seq.token_ids[: seq.num_prompt_tokens])][end - seq.num_prompt_tokens :][:k]
        self.calls += 1
        if self.calls % 3 == 0 and len(future) > 2:
            future[2] = (future[2] + 1) % 256
        return future


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_speculation_with_verifying_graphs_equals_no_speculation(tiny_checkpoint, kv_cache_dtype: str) -> None:
    """fp32 on CUDA: drafts verified through the captured graphs (the split-KV decode kernel with 1 + k
    queries, sequences padded to the graph's 1 + k, the batch to its bucket) give the tokens of the
    engine without speculation, with drafts kept and drafts rejected; the verifying graphs ran."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded = load_model(str(tiny_checkpoint("llama")), device="cuda", dtype=torch.float32)
    prompts = _prompts(5)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    off_core = make_core(loaded, block_size=16, speculative="off", kv_cache_dtype=kv_cache_dtype)
    off_core.warm_up()
    off = [r["tokens"][0] for r in run_all(off_core, prompts, params)]
    core = make_core(loaded, block_size=16, speculative="ngram", kv_cache_dtype=kv_cache_dtype)
    core.warm_up()
    core.scheduler.speculator.drafter = _OracleDrafter({tuple(p): t for p, t in zip(prompts, off)})
    core.scheduler.speculator.backoff = False
    on = [r["tokens"][0] for r in run_all(core, prompts, params)]
    assert core.block_manager.num_used_blocks == 0
    stats = core.stats().speculation
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert core.runner.graphs is not None and core.runner.graphs.replays[1] > 0
    same = sum(a == b for a, b in zip(on, off))
    # fp8: the K/V bytes are the same, the sums run in another order (a near-tie may flip a late token)
    assert same == len(prompts) if kv_cache_dtype == "auto" else same >= len(prompts) - 1


@pytest.mark.parametrize("dtype,kv_cache_dtype", [(torch.float32, "auto"), (torch.bfloat16, "auto"),
                                                  (torch.float32, "fp8")])  # fmt: skip
def test_overlap_graphs_and_backends_agree_on_cuda(tiny_checkpoint, dtype, kv_cache_dtype: str) -> None:
    """Overlap on/off x graphs on/off x triton/torch attention: identical greedy tokens (fp32), or
    agreement up to a near-tie (bf16: batch composition changes GEMM shapes; fp8: the kernel and the
    reference may round a value to neighbouring e4m3 steps); nothing leaks."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loaded = load_model(str(tiny_checkpoint("qwen2")), device="cuda", dtype=dtype)
    prompts = _prompts(12)
    params = [
        SamplingParams(max_tokens=20 + i, temperature=0.0, ignore_eos=True, n=1 + (i % 4 == 0)) for i in range(12)
    ]
    runs = {}
    for overlap, graphs, backend in [("off", False, "torch"), ("off", False, "triton"), ("on", False, "triton"),
                                     ("off", True, "triton"), ("on", True, "triton")]:  # fmt: skip
        core = make_core(
            loaded, block_size=16, overlap=overlap, cuda_graphs=graphs, attention_backend=backend,
            kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        core.warm_up()
        runs[(overlap, graphs, backend)] = [r["tokens"] for r in run_all(core, prompts, params)]
        assert core.block_manager.num_used_blocks == 0
    reference = runs[("off", False, "torch")]
    for key, tokens in runs.items():
        if dtype == torch.float32 and kv_cache_dtype == "auto":
            assert tokens == reference, key
        else:
            same = sum(a == b for a, b in zip(tokens, reference))
            assert same >= len(reference) - 2, (key, same)  # bf16 near-ties may flip a late token


def test_cuda_bf16_logprobs_agree_with_cpu_fp32(tiny_checkpoint) -> None:
    directory = str(tiny_checkpoint("llama"))
    prompts = _prompts(6)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)
    cpu = run_all(make_core(load_model(directory)), prompts, params)
    gpu_core = make_core(load_model(directory, device="cuda", dtype=torch.bfloat16), block_size=16)
    gpu_core.warm_up()
    gpu = run_all(gpu_core, prompts, params)
    for a, b in zip(cpu, gpu):
        first_a = a["outputs"][0].candidates[0].logprobs[0]
        first_b = b["outputs"][0].candidates[0].logprobs[0]
        top_a = [lp for _, lp in first_a.top]
        top_b = [lp for _, lp in first_b.top]
        # bf16 logits carry ~3 significant digits (steps of 1/64 near 2-4): a relative tolerance.
        assert all(abs(x - y) <= 0.1 * abs(x) + 0.05 for x, y in zip(top_a, top_b)), (top_a, top_b)
        assert first_a.top[0][0] == first_b.top[0][0] or abs(top_a[0] - top_a[1]) < 0.2


def test_constrained_and_unconstrained_rows_in_one_cuda_graph_batch(tiny_checkpoint) -> None:
    """Unconstrained sequences decoded in CUDA-graph batches beside grammar-constrained ones sample the
    tokens they sample in a run without any grammar; the constrained ones match their regex."""
    import re

    from cbd.engine.grammar.matcher import GrammarCompiler, GrammarKind, GrammarSpec

    vocab = [bytes([i]) for i in range(256)]  # the tiny model's 256 ids as single bytes; id 1 is its EOS
    compiler = GrammarCompiler(None, 256, (1,), encoded_vocab=vocab)
    grammar = compiler.compile(GrammarSpec(GrammarKind.REGEX, "[a-z]{30}"))
    prompts = _prompts(12)
    plain = [SamplingParams(max_tokens=40, temperature=t, seed=3, ignore_eos=True) for t in (0.0, 0.7)] * 3
    constrained = [SamplingParams(max_tokens=40, temperature=t, seed=4, grammar=grammar) for t in (0.0, 1.0)] * 3
    loaded = load_model(str(tiny_checkpoint("llama")), device="cuda")
    for overlap in ("on", "off"):
        cores = [make_core(loaded, overlap=overlap, max_num_seqs=16) for _ in range(2)]
        for core in cores:
            core.warm_up()  # captures the decode graphs
            assert core.runner.graphs is not None and core.runner.graphs.graphs
        alone = run_all(cores[0], prompts[:6], plain)
        mixed = run_all(cores[1], prompts, plain + constrained)
        assert [r["tokens"] for r in mixed[:6]] == [r["tokens"] for r in alone]
        for r in mixed[6:]:
            text = bytes(t for t in r["tokens"][0] if t != 1).decode()
            assert r["finish"][0].value == "stop" and re.fullmatch("[a-z]{30}", text), text


def test_background_save_gathers_on_the_writer_thread_while_steps_run_on_cuda(tiny_checkpoint, tmp_path) -> None:
    """save_idle names a session's GPU blocks; the disk tier's writer thread gathers them on a stream of its own
    while another request's steps run on the compute stream; the file holds the KV the session had, and a daemon
    started on the files answers its next turn as the one that never stopped."""
    import threading

    from cbd.engine.kv import disk_tier
    from cbd.engine.kv import session_files as files

    directory = str(tiny_checkpoint("llama"))
    config = dict(disk_kv_dir=str(tmp_path), block_size=8, num_kv_blocks=64, num_host_kv_blocks=64)
    core = make_core(load_model(directory, device="cuda"), **config)
    key = core.sessions.open(session_id="saved").session_id
    rng = random.Random(2)
    history = [rng.randrange(2, 256) for _ in range(200)]
    _session_turn(core, key, history)
    session = core.sessions.sessions[key]
    assert core.checkpoints is not None
    disk = core.checkpoints.disk
    want = bytes(disk_tier.raw_bytes(disk.gather_gpu(list(session.block_table))))
    gate = threading.Event()
    disk._writer.submit(gate.wait, 30)
    # Another request's prefill in flight on the compute stream when the save is queued.
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    request = core.add_request([rng.randrange(2, 256) for _ in range(150)], params)
    core.step()
    assert core.checkpoints.save_idle(0.0) == 1 and core.checkpoints.held_blocks()
    core.sessions.eviction.evict(core.block_manager.num_blocks)  # to the host tier: its GPU blocks released, held
    assert not session.block_table and session.host is not None
    core.add_request([rng.randrange(2, 256) for _ in range(100)], params)  # takes the blocks not held
    core.step()
    gate.set()  # the writer gathers while the requests' steps go on
    while core.has_work():
        core.step()
    core.check_integrity()
    assert request.request_id and disk.flush(30)
    path = tmp_path / "engine" / files.file_name(key)
    saved, _ = files.read_header(path)
    got = files.read_kv(path, saved.branches[0])
    assert got is not None and bytes(got) == want
    never_stopped = _session_turn(core, key, [5, 6, 7])
    disk.close()
    restarted = make_core(load_model(directory, device="cuda"), **config)
    assert restarted.checkpoints is not None and restarted.checkpoints.restore() == [key]
    assert _session_turn(restarted, key, [5, 6, 7]) == never_stopped
    assert restarted.sessions.hits["disk"] == 1
    restarted.checkpoints.disk.close()


def _session_turn(core, key: str, tokens: list[int]) -> list[int]:
    request = core.add_session_turn(key, tokens, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    out: list[int] = []
    while core.has_work():
        for o in core.step():
            if o.request_id == request.request_id:
                out += [t for d in o.candidates for t in d.token_ids]
    return out


def test_the_host_reads_host_blocks_after_their_own_copies_only(tiny_checkpoint) -> None:
    """Reading host blocks (a spill's gather) waits for the copies to or from those blocks, not for one to other
    blocks queued behind a step the GPU is still computing; a read of the blocks that copy fills waits for it."""
    core = make_core(
        load_model(str(tiny_checkpoint("llama")), device="cuda"), block_size=8, num_kv_blocks=64, num_host_kv_blocks=64
    )
    tier = core.host_tier
    assert tier is not None
    copier, compute = tier.copier, tier.copier.streams.compute
    with torch.cuda.stream(compute):
        copier.gpu[:, :2] = 3.0
        torch.cuda._sleep(2_000_000_000)  # a long step in flight on the compute stream
    ticket = copier.offload([0, 1], [10, 11])  # queued behind it
    copier.host[20] = 7.0  # a block no copy touches
    assert bool((tier.read_blocks([20]) == 7.0).all())
    assert not copier.is_done(ticket)  # the read did not wait for the step
    assert bool((tier.read_blocks([10, 11]) == 3.0).all())  # this one waited for the offload
    assert copier.is_done(ticket)
