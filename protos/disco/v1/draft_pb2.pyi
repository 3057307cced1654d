from protos.disco.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StartDraftSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "sampling", "policy", "reference_ids", "overlap")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    policy: str
    reference_ids: _containers.RepeatedScalarFieldContainer[int]
    overlap: bool
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., policy: _Optional[str] = ..., reference_ids: _Optional[_Iterable[int]] = ..., overlap: _Optional[bool] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "feedback", "max_lookahead", "expected_length")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    MAX_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    feedback: _common_pb2.Feedback
    max_lookahead: int
    expected_length: int
    def __init__(self, session_id: _Optional[str] = ..., feedback: _Optional[_Union[_common_pb2.Feedback, _Mapping]] = ..., max_lookahead: _Optional[int] = ..., expected_length: _Optional[int] = ...) -> None: ...

class DraftEvent(_message.Message):
    __slots__ = ("token", "summary")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    token: DraftToken
    summary: DraftSummary
    def __init__(self, token: _Optional[_Union[DraftToken, _Mapping]] = ..., summary: _Optional[_Union[DraftSummary, _Mapping]] = ...) -> None: ...

class DraftToken(_message.Message):
    __slots__ = ("token_id", "draft_prob", "draft_probs", "elapsed_ns")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROB_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    draft_prob: float
    draft_probs: _common_pb2.Distribution
    elapsed_ns: int
    def __init__(self, token_id: _Optional[int] = ..., draft_prob: _Optional[float] = ..., draft_probs: _Optional[_Union[_common_pb2.Distribution, _Mapping]] = ..., elapsed_ns: _Optional[int] = ...) -> None: ...

class DraftSummary(_message.Message):
    __slots__ = ("forwards", "elapsed_ns", "stop_reason", "predrafted_used", "predrafted_wasted", "overlap_hit", "overlap_miss")
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_NS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_USED_FIELD_NUMBER: _ClassVar[int]
    PREDRAFTED_WASTED_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_HIT_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_MISS_FIELD_NUMBER: _ClassVar[int]
    forwards: int
    elapsed_ns: int
    stop_reason: str
    predrafted_used: int
    predrafted_wasted: int
    overlap_hit: bool
    overlap_miss: bool
    def __init__(self, forwards: _Optional[int] = ..., elapsed_ns: _Optional[int] = ..., stop_reason: _Optional[str] = ..., predrafted_used: _Optional[int] = ..., predrafted_wasted: _Optional[int] = ..., overlap_hit: _Optional[bool] = ..., overlap_miss: _Optional[bool] = ...) -> None: ...
