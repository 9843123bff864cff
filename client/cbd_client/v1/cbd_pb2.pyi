from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolChoiceMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_MODE_AUTO: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_NONE: _ClassVar[ToolChoiceMode]
    TOOL_CHOICE_MODE_REQUIRED: _ClassVar[ToolChoiceMode]

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    PRIORITY_INTERACTIVE: _ClassVar[Priority]
    PRIORITY_BATCH: _ClassVar[Priority]

class Retention(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETENTION_UNSPECIFIED: _ClassVar[Retention]
    RETENTION_LOW: _ClassVar[Retention]
    RETENTION_NORMAL: _ClassVar[Retention]
    RETENTION_HIGH: _ClassVar[Retention]

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_NONE: _ClassVar[KvTier]
    KV_TIER_GPU: _ClassVar[KvTier]
    KV_TIER_HOST: _ClassVar[KvTier]
    KV_TIER_RECOMPUTE: _ClassVar[KvTier]
    KV_TIER_DISK: _ClassVar[KvTier]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
TOOL_CHOICE_MODE_AUTO: ToolChoiceMode
TOOL_CHOICE_MODE_NONE: ToolChoiceMode
TOOL_CHOICE_MODE_REQUIRED: ToolChoiceMode
PRIORITY_UNSPECIFIED: Priority
PRIORITY_INTERACTIVE: Priority
PRIORITY_BATCH: Priority
RETENTION_UNSPECIFIED: Retention
RETENTION_LOW: Retention
RETENTION_NORMAL: Retention
RETENTION_HIGH: Retention
KV_TIER_NONE: KvTier
KV_TIER_GPU: KvTier
KV_TIER_HOST: KvTier
KV_TIER_RECOMPUTE: KvTier
KV_TIER_DISK: KvTier
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("mode", "name", "at_most_one_call")
    MODE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    AT_MOST_ONE_CALL_FIELD_NUMBER: _ClassVar[int]
    mode: ToolChoiceMode
    name: str
    at_most_one_call: bool
    def __init__(self, mode: _Optional[_Union[ToolChoiceMode, str]] = ..., name: _Optional[str] = ..., at_most_one_call: _Optional[bool] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class Chat(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "continue_final_message")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "include_special_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    include_special_tokens: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., include_special_tokens: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "chat", "tokens", "sampling", "n", "request_id", "session_id", "parent_candidate", "tools", "tool_choice", "response_format", "expected_idle_ms", "retention", "priority", "tenant", "allow_special_tokens", "whole_conversation", "stream_interval")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WHOLE_CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: Chat
    tokens: TokenIds
    sampling: SamplingParams
    n: int
    request_id: str
    session_id: str
    parent_candidate: int
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: ToolChoice
    response_format: ResponseFormat
    expected_idle_ms: int
    retention: Retention
    priority: Priority
    tenant: str
    allow_special_tokens: bool
    whole_conversation: bool
    stream_interval: int
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., parent_candidate: _Optional[int] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., expected_idle_ms: _Optional[int] = ..., retention: _Optional[_Union[Retention, str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., tenant: _Optional[str] = ..., allow_special_tokens: _Optional[bool] = ..., whole_conversation: _Optional[bool] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., token: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class CandidateDelta(_message.Message):
    __slots__ = ("index", "text", "token_ids", "logprobs", "finish_reason", "usage", "tool_calls")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    usage: Usage
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "candidates", "usage", "prompt_usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    candidates: _containers.RepeatedCompositeFieldContainer[CandidateDelta]
    usage: Usage
    prompt_usage: Usage
    def __init__(self, request_id: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[CandidateDelta, _Mapping]]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prompt_usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "chat", "allow_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: Chat
    allow_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., allow_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "count")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    count: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "architecture", "context_length", "vocab_size", "dtype", "device", "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "max_n", "max_logprobs", "max_stop_strings", "max_queued_requests", "eos_token_ids", "has_chat_template", "max_tools", "max_grammar_bytes", "tool_call_format", "kv_cache_dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_N_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAMMAR_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    context_length: int
    vocab_size: int
    dtype: str
    device: str
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_n: int
    max_logprobs: int
    max_stop_strings: int
    max_queued_requests: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_chat_template: bool
    max_tools: int
    max_grammar_bytes: int
    tool_call_format: str
    kv_cache_dtype: str
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_n: _Optional[int] = ..., max_logprobs: _Optional[int] = ..., max_stop_strings: _Optional[int] = ..., max_queued_requests: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., has_chat_template: _Optional[bool] = ..., max_tools: _Optional[int] = ..., max_grammar_bytes: _Optional[int] = ..., tool_call_format: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Stats(_message.Message):
    __slots__ = ("running", "waiting", "live_requests", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "kv_blocks_cached", "uptime_seconds", "num_preemptions", "num_steps", "generated_tokens", "open_sessions", "session_evictions", "host_kv_blocks_total", "host_kv_blocks_used", "kv_blocks_offloaded", "kv_blocks_restored", "restored_prompt_tokens", "priority_preemptions", "draft_tokens", "accepted_draft_tokens", "speculative_steps", "session_files", "session_file_bytes", "session_files_written", "session_files_written_with_kv", "session_file_write_errors", "session_file_bytes_written", "session_file_bytes_read", "session_kv_reads", "session_kv_read_failures", "sessions_restored", "sessions_lost", "last_save_seconds", "sessions_spilled", "device_drafted_steps")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RESTORED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_STEPS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FILES_FIELD_NUMBER: _ClassVar[int]
    SESSION_FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSION_FILES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FILES_WRITTEN_WITH_KV_FIELD_NUMBER: _ClassVar[int]
    SESSION_FILE_WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FILE_BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FILE_BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    SESSION_KV_READS_FIELD_NUMBER: _ClassVar[int]
    SESSION_KV_READ_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_RESTORED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_LOST_FIELD_NUMBER: _ClassVar[int]
    LAST_SAVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_SPILLED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_DRAFTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    live_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    uptime_seconds: float
    num_preemptions: int
    num_steps: int
    generated_tokens: int
    open_sessions: int
    session_evictions: int
    host_kv_blocks_total: int
    host_kv_blocks_used: int
    kv_blocks_offloaded: int
    kv_blocks_restored: int
    restored_prompt_tokens: int
    priority_preemptions: int
    draft_tokens: int
    accepted_draft_tokens: int
    speculative_steps: int
    session_files: int
    session_file_bytes: int
    session_files_written: int
    session_files_written_with_kv: int
    session_file_write_errors: int
    session_file_bytes_written: int
    session_file_bytes_read: int
    session_kv_reads: int
    session_kv_read_failures: int
    sessions_restored: int
    sessions_lost: int
    last_save_seconds: float
    sessions_spilled: int
    device_drafted_steps: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., live_requests: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., uptime_seconds: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., open_sessions: _Optional[int] = ..., session_evictions: _Optional[int] = ..., host_kv_blocks_total: _Optional[int] = ..., host_kv_blocks_used: _Optional[int] = ..., kv_blocks_offloaded: _Optional[int] = ..., kv_blocks_restored: _Optional[int] = ..., restored_prompt_tokens: _Optional[int] = ..., priority_preemptions: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., speculative_steps: _Optional[int] = ..., session_files: _Optional[int] = ..., session_file_bytes: _Optional[int] = ..., session_files_written: _Optional[int] = ..., session_files_written_with_kv: _Optional[int] = ..., session_file_write_errors: _Optional[int] = ..., session_file_bytes_written: _Optional[int] = ..., session_file_bytes_read: _Optional[int] = ..., session_kv_reads: _Optional[int] = ..., session_kv_read_failures: _Optional[int] = ..., sessions_restored: _Optional[int] = ..., sessions_lost: _Optional[int] = ..., last_save_seconds: _Optional[float] = ..., sessions_spilled: _Optional[int] = ..., device_drafted_steps: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("ttl_seconds", "text", "chat", "tokens", "session_id", "expected_idle_ms", "retention", "priority", "allow_special_tokens")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ALLOW_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    text: str
    chat: Chat
    tokens: TokenIds
    session_id: str
    expected_idle_ms: int
    retention: Retention
    priority: Priority
    allow_special_tokens: bool
    def __init__(self, ttl_seconds: _Optional[float] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[Chat, _Mapping]] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., session_id: _Optional[str] = ..., expected_idle_ms: _Optional[int] = ..., retention: _Optional[_Union[Retention, str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., allow_special_tokens: _Optional[bool] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "num_tokens", "resident_blocks", "pending_candidates", "idle_seconds", "busy", "ttl_seconds", "is_chat", "kv_tier", "host_blocks", "expected_idle_ms", "retention", "priority", "tenant", "disk_blocks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IS_CHAT_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    resident_blocks: int
    pending_candidates: int
    idle_seconds: float
    busy: bool
    ttl_seconds: float
    is_chat: bool
    kv_tier: KvTier
    host_blocks: int
    expected_idle_ms: int
    retention: Retention
    priority: Priority
    tenant: str
    disk_blocks: int
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., resident_blocks: _Optional[int] = ..., pending_candidates: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., busy: _Optional[bool] = ..., ttl_seconds: _Optional[float] = ..., is_chat: _Optional[bool] = ..., kv_tier: _Optional[_Union[KvTier, str]] = ..., host_blocks: _Optional[int] = ..., expected_idle_ms: _Optional[int] = ..., retention: _Optional[_Union[Retention, str]] = ..., priority: _Optional[_Union[Priority, str]] = ..., tenant: _Optional[str] = ..., disk_blocks: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("all_tenants",)
    ALL_TENANTS_FIELD_NUMBER: _ClassVar[int]
    all_tenants: bool
    def __init__(self, all_tenants: _Optional[bool] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ...) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("session_id", "candidate", "ttl_seconds", "new_session_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    candidate: int
    ttl_seconds: float
    new_session_id: str
    def __init__(self, session_id: _Optional[str] = ..., candidate: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., new_session_id: _Optional[str] = ...) -> None: ...
