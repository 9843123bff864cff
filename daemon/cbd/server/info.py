"""The daemon's facts and figures as the gRPC API shows them: GetModelInfo's and GetStats's messages."""

from __future__ import annotations

from typing import Any

from cbd.config import EngineConfig
from cbd.engine.grammar.matcher import MAX_GRAMMAR_BYTES
from cbd.engine.outputs import DiskTierStats, EngineStats, ModelFacts
from cbd.engine.sampling_params import MAX_CANDIDATES, MAX_LOGPROBS, MAX_STOP_STRINGS
from cbd.server.prompts import PromptEncoder
from cbd.server.tool_calls import MAX_TOOLS
from cbd_client.v1 import cbd_pb2 as pb


def model_info(facts: ModelFacts, config: EngineConfig, prompts: PromptEncoder) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=facts.name,
        architecture=facts.architecture,
        context_length=facts.max_model_len,
        vocab_size=facts.vocab_size,
        dtype=facts.dtype,
        device=facts.device,
        block_size=facts.block_size,
        num_kv_blocks=facts.num_kv_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_n=min(MAX_CANDIDATES, config.max_num_seqs),  # a request's candidates run at once
        max_logprobs=MAX_LOGPROBS,
        max_stop_strings=MAX_STOP_STRINGS,
        max_queued_requests=config.max_queued_requests,
        eos_token_ids=facts.eos_token_ids,
        has_chat_template=prompts.has_chat_template,
        max_tools=MAX_TOOLS,
        max_grammar_bytes=MAX_GRAMMAR_BYTES,
        tool_call_format=prompts.call_format.name,
        kv_cache_dtype="fp8" if config.kv_cache_dtype == "fp8" else facts.dtype,
    )


def stats(s: EngineStats, live_requests: int, uptime: float) -> pb.Stats:
    return pb.Stats(
        running=s.num_running,
        waiting=s.num_waiting,
        live_requests=live_requests,
        kv_blocks_total=s.num_blocks,
        kv_blocks_used=s.num_blocks_used,
        kv_blocks_free=s.num_blocks_free,
        kv_blocks_cached=s.num_blocks_cached,
        uptime_seconds=uptime,
        num_preemptions=s.num_preemptions,
        num_steps=s.num_steps,
        generated_tokens=s.num_generated_tokens,
        open_sessions=s.num_sessions,
        session_evictions=s.num_session_evictions,
        priority_preemptions=s.num_priority_preemptions,
        host_kv_blocks_total=s.host.num_blocks if s.host else 0,
        host_kv_blocks_used=s.host.num_blocks_used if s.host else 0,
        kv_blocks_offloaded=s.host.num_offloaded_blocks if s.host else 0,
        kv_blocks_restored=s.host.num_restored_blocks if s.host else 0,
        restored_prompt_tokens=s.host.num_restored_tokens if s.host else 0,
        draft_tokens=s.speculation.num_draft_tokens if s.speculation else 0,
        accepted_draft_tokens=s.speculation.num_accepted_tokens if s.speculation else 0,
        speculative_steps=s.speculation.num_steps if s.speculation else 0,
        device_drafted_steps=s.speculation.num_device_drafted if s.speculation else 0,
        **(_session_files(s.disk) if s.disk else {}),
    )


def _session_files(d: DiskTierStats) -> dict[str, Any]:
    return {
        "session_files": d.num_files, "session_file_bytes": d.bytes_on_disk,
        "session_files_written": d.num_files_written, "session_files_written_with_kv": d.num_kv_files_written,
        "session_file_write_errors": d.num_write_errors, "session_file_bytes_written": d.bytes_written,
        "session_file_bytes_read": d.bytes_read, "session_kv_reads": d.num_kv_loads,
        "session_kv_read_failures": d.num_kv_load_failures, "sessions_restored": d.num_sessions_restored,
        "sessions_lost": d.num_sessions_lost, "last_save_seconds": d.last_checkpoint_seconds,
        "sessions_spilled": d.num_spilled,
    }  # fmt: skip
