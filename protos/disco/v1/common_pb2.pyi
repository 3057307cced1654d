from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs", "prompt_logprobs", "stop_token_ids", "min_tokens", "include_stop_str_in_output", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "bad_words", "bad_words_token_ids", "eos_token_ids", "resumed_tokens", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    prompt_logprobs: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    min_tokens: int
    include_stop_str_in_output: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resumed_tokens: int
    structured: StructuredOutput
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., min_tokens: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., bad_words: _Optional[_Iterable[str]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., resumed_tokens: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Distribution(_message.Message):
    __slots__ = ("vocab_size", "dense_f32", "sparse")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DENSE_F32_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    dense_f32: bytes
    sparse: SparseDistribution
    def __init__(self, vocab_size: _Optional[int] = ..., dense_f32: _Optional[bytes] = ..., sparse: _Optional[_Union[SparseDistribution, _Mapping]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("ids_u32", "probs_f32")
    IDS_U32_FIELD_NUMBER: _ClassVar[int]
    PROBS_F32_FIELD_NUMBER: _ClassVar[int]
    ids_u32: bytes
    probs_f32: bytes
    def __init__(self, ids_u32: _Optional[bytes] = ..., probs_f32: _Optional[bytes] = ...) -> None: ...

class Feedback(_message.Message):
    __slots__ = ("num_accepted", "bonus_token_id")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    bonus_token_id: int
    def __init__(self, num_accepted: _Optional[int] = ..., bonus_token_id: _Optional[int] = ...) -> None: ...

class StartSessionResponse(_message.Message):
    __slots__ = ("prompt_tokens", "elapsed_ns", "prompt_logprobs")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    elapsed_ns: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, prompt_tokens: _Optional[int] = ..., elapsed_ns: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprob", "rank", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("elapsed_ns",)
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    elapsed_ns: int
    def __init__(self, elapsed_ns: _Optional[int] = ...) -> None: ...

class ServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServiceInfo(_message.Message):
    __slots__ = ("role", "model_name", "fingerprint", "tokenizer_hash", "vocab_size", "max_context", "eos_token_ids", "dtype", "device", "active_sessions", "max_sessions", "idle_ttl_s", "version", "elapsed_ns", "forward_s", "overlap", "batching", "live_forward_s", "exactness", "kernel", "security", "prefill_s_per_token", "prefill_window", "prefill", "forward")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    IDLE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    LIVE_FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    EXACTNESS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    SECURITY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WINDOW_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    role: str
    model_name: str
    fingerprint: str
    tokenizer_hash: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    active_sessions: int
    max_sessions: int
    idle_ttl_s: float
    version: str
    elapsed_ns: int
    forward_s: _containers.RepeatedScalarFieldContainer[float]
    overlap: bool
    batching: str
    live_forward_s: _containers.RepeatedScalarFieldContainer[float]
    exactness: str
    kernel: str
    security: str
    prefill_s_per_token: float
    prefill_window: int
    prefill: str
    forward: str
    def __init__(self, role: _Optional[str] = ..., model_name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., tokenizer_hash: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., active_sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., idle_ttl_s: _Optional[float] = ..., version: _Optional[str] = ..., elapsed_ns: _Optional[int] = ..., forward_s: _Optional[_Iterable[float]] = ..., overlap: _Optional[bool] = ..., batching: _Optional[str] = ..., live_forward_s: _Optional[_Iterable[float]] = ..., exactness: _Optional[str] = ..., kernel: _Optional[str] = ..., security: _Optional[str] = ..., prefill_s_per_token: _Optional[float] = ..., prefill_window: _Optional[int] = ..., prefill: _Optional[str] = ..., forward: _Optional[str] = ...) -> None: ...
