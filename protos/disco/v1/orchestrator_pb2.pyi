from protos.disco.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_ids", "chat", "policy", "max_lookahead", "sampling", "overlap", "messages", "echo", "tools_json", "continue_final_message")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    chat: bool
    policy: str
    max_lookahead: int
    sampling: _common_pb2.SamplingParams
    overlap: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    echo: bool
    tools_json: str
    continue_final_message: bool
    def __init__(self, prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., chat: _Optional[bool] = ..., policy: _Optional[str] = ..., max_lookahead: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., overlap: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., echo: _Optional[bool] = ..., tools_json: _Optional[str] = ..., continue_final_message: _Optional[bool] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "result")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    chunk: GenerateChunk
    result: GenerateResult
    def __init__(self, chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., result: _Optional[_Union[GenerateResult, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "elapsed_ns", "logprobs", "prompt_logprobs", "prompt_text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    elapsed_ns: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., elapsed_ns: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob", "rank", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    rank: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "token", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., token: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats", "elapsed_ns", "logprobs", "prompt_logprobs", "prompt_text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: RequestStats
    elapsed_ns: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., elapsed_ns: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("prompt_tokens", "generated_tokens", "iterations", "draft_tokens", "accepted_tokens", "acceptance_rate", "lookaheads", "accepted_per_position", "target_forwards", "draft_forwards", "prefill_s", "draft_s", "verify_s", "wall_s", "tokens_per_s", "mean_lookahead", "finish_reason", "draft_fallbacks", "target_reprefills", "backend_draft_s", "backend_verify_s", "draft_reprefills", "overlap_hits", "overlap_misses", "predrafted_used", "predrafted_wasted", "seed", "draft_calls", "verify_forward_s")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEADS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    TARGET_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    TARGET_REPREFILLS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_DRAFT_S_FIELD_NUMBER: _ClassVar[int]
    BACKEND_VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REPREFILLS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_HITS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_USED_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_WASTED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CALLS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    generated_tokens: int
    iterations: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    lookaheads: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    target_forwards: int
    draft_forwards: int
    prefill_s: float
    draft_s: float
    verify_s: float
    wall_s: float
    tokens_per_s: float
    mean_lookahead: float
    finish_reason: str
    draft_fallbacks: int
    target_reprefills: int
    backend_draft_s: float
    backend_verify_s: float
    draft_reprefills: int
    overlap_hits: int
    overlap_misses: int
    predrafted_used: int
    predrafted_wasted: int
    seed: int
    draft_calls: int
    verify_forward_s: float
    def __init__(self, prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., iterations: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., lookaheads: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., target_forwards: _Optional[int] = ..., draft_forwards: _Optional[int] = ..., prefill_s: _Optional[float] = ..., draft_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., wall_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., mean_lookahead: _Optional[float] = ..., finish_reason: _Optional[str] = ..., draft_fallbacks: _Optional[int] = ..., target_reprefills: _Optional[int] = ..., backend_draft_s: _Optional[float] = ..., backend_verify_s: _Optional[float] = ..., draft_reprefills: _Optional[int] = ..., overlap_hits: _Optional[int] = ..., overlap_misses: _Optional[int] = ..., predrafted_used: _Optional[int] = ..., predrafted_wasted: _Optional[int] = ..., seed: _Optional[int] = ..., draft_calls: _Optional[int] = ..., verify_forward_s: _Optional[float] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("version", "policies", "draft", "target", "limits", "active_sessions", "draft_address", "target_address", "errors", "elapsed_ns")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    version: str
    policies: _containers.RepeatedCompositeFieldContainer[PolicyInfo]
    draft: _common_pb2.ServiceInfo
    target: _common_pb2.ServiceInfo
    limits: Limits
    active_sessions: ActiveSessions
    draft_address: str
    target_address: str
    errors: _containers.RepeatedScalarFieldContainer[str]
    elapsed_ns: int
    def __init__(self, version: _Optional[str] = ..., policies: _Optional[_Iterable[_Union[PolicyInfo, _Mapping]]] = ..., draft: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., target: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., active_sessions: _Optional[_Union[ActiveSessions, _Mapping]] = ..., draft_address: _Optional[str] = ..., target_address: _Optional[str] = ..., errors: _Optional[_Iterable[str]] = ..., elapsed_ns: _Optional[int] = ...) -> None: ...

class PolicyInfo(_message.Message):
    __slots__ = ("name", "syntax", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SYNTAX_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    syntax: str
    description: str
    def __init__(self, name: _Optional[str] = ..., syntax: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_new_tokens", "max_lookahead", "max_sessions", "max_context", "max_prompt_tokens")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    max_lookahead: int
    max_sessions: int
    max_context: int
    max_prompt_tokens: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., max_lookahead: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_context: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ...) -> None: ...

class ActiveSessions(_message.Message):
    __slots__ = ("orchestrator", "draft", "target")
    ORCHESTRATOR_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    orchestrator: int
    draft: int
    target: int
    def __init__(self, orchestrator: _Optional[int] = ..., draft: _Optional[int] = ..., target: _Optional[int] = ...) -> None: ...
