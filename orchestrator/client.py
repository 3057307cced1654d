"""Python client of the public ``disco.v1.Orchestrator`` API.

Example::

    from orchestrator.client import DiscoClient

    with DiscoClient("127.0.0.1:50051", timeout=60) as client:
        result = client.generate("def fib(n):", policy="static:6", max_new_tokens=64)
        print(result.text, result.stats["acceptance_rate"])

        stream = client.stream("def fib(n):", max_new_tokens=64)
        for chunk in stream:                # chunks arrive as tokens are accepted
            print(chunk.text, end="")
        print(stream.result.finish_reason)  # the final result, once the stream ended

    # TLS (verify the server with ca.pem; present a client certificate if it asks for one)
    # and a bearer token (default: $DISCO_AUTH_TOKEN):
    DiscoClient("orchestrator.example:50051", tls_ca="ca.pem", tls_cert="me.pem", tls_key="me.key",
                auth_token="...")

:class:`AsyncDiscoClient` offers the same methods on ``grpc.aio``. Every failed call
raises :class:`DiscoRpcError`, a :class:`grpc.RpcError` with ``code()`` and ``details()``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc

from protos.disco.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from protos.runtime.auth import auth_metadata, auth_token_from_env
from protos.runtime.tls import TlsFiles, aio_channel, secure_channel
from protos.stats import stats_from_pb

DEFAULT_TIMEOUT_S = 300.0
#: Largest answer the clients accept: a result with many logprobs exceeds gRPC's 4 MiB default
#: (the server bounds it: disco.config.MAX_LOGPROB_ENTRIES).
MAX_RECEIVE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = (("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),)


class DiscoRpcError(grpc.RpcError):
    """A failed call: ``code()`` is the :class:`grpc.StatusCode`, ``details()`` the message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    @classmethod
    def wrap(cls, error: grpc.RpcError) -> "DiscoRpcError":
        return error if isinstance(error, cls) else cls(error.code(), error.details() or "")


@dataclass(frozen=True)
class TopLogprob:
    """One of a position's most likely tokens (``disco.v1.TopLogprob``)."""

    token_id: int
    token: str  # the token alone as text, special tokens kept
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The target's raw log-probabilities at one position (``disco.v1.TokenLogprob``)."""

    token_id: int
    token: str  # the token alone as text, special tokens kept
    logprob: float | None  # None: the first prompt token (nothing precedes it)
    rank: int  # of the token at this position, 1: the most likely (0 with no logprob)
    top_logprobs: list[TopLogprob]  # the position's most likely tokens, most likely first


@dataclass(frozen=True)
class Chunk:
    """Tokens accepted in one iteration and their text delta."""

    token_ids: list[int]
    text: str
    elapsed_ns: int  # server-side time since the request began
    logprobs: list[TokenLogprob] = field(default_factory=list)  # asked (logprobs=N): one per token
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # asked: the first chunk's, one per prompt token
    prompt_text: str = ""  # echo: the first chunk's


@dataclass(frozen=True)
class Completion:
    """A whole generation; ``stats`` has the keys of :meth:`disco.stats.RequestStats.to_dict`."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" or "length"
    stats: dict
    elapsed_ns: int  # server-side time of the request
    logprobs: list[TokenLogprob] = field(default_factory=list)  # asked (logprobs=N): one per token
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # asked (prompt_logprobs=N): one per prompt token
    prompt_text: str = ""  # echo: the prompt as text


def _message_pb(message: tuple[str, str] | dict) -> orchestrator_pb2.ChatMessage:
    if not isinstance(message, dict):
        role, content = message
        return orchestrator_pb2.ChatMessage(role=role, content=content)
    calls = message.get("tool_calls")
    return orchestrator_pb2.ChatMessage(role=message["role"], content=message.get("content") or "",
                                        tool_calls_json=json.dumps(calls) if calls else "",
                                        tool_call_id=message.get("tool_call_id") or "", name=message.get("name") or "")


def build_request(prompt: str = "", *, prompt_ids: Sequence[int] | None = None, chat: bool = False,
                  policy: str = "", max_lookahead: int | None = None, max_new_tokens: int | None = None,
                  temperature: float = 0.0, top_p: float | None = None, top_k: int = 0, seed: int | None = None,
                  stop: Sequence[str] = (), ignore_eos: bool = False,
                  overlap: bool | None = None,
                  messages: Sequence[tuple[str, str]] = (), logprobs: int | None = None,
                  prompt_logprobs: int | None = None, echo: bool = False,
                  stop_token_ids: Sequence[int] = (), min_tokens: int = 0, include_stop_str_in_output: bool = False,
                  repetition_penalty: float | None = None, presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0, logit_bias: dict[int, float] | None = None, min_p: float = 0.0,
                  bad_words: Sequence[str] = (),
                  structured: tuple[str, str] | None = None, tools: Sequence[dict] | None = None,
                  continue_final_message: bool = False) -> orchestrator_pb2.GenerateRequest:
    """The ``GenerateRequest`` for these arguments (``None``/empty: the server default;
    ``overlap``: overlapped drafting for this request, ``None``: the draft service's setting;
    ``messages``: a conversation instead of ``prompt``, of ``(role, content)`` pairs or OpenAI
    message dicts (``tool_calls``, ``tool_call_id``, ``name``); ``tools``: OpenAI's tool objects
    for the chat template; ``continue_final_message``: continue the last (assistant) message;
    ``logprobs`` / ``prompt_logprobs``: the target's log-probabilities of the generated / prompt
    tokens with this many alternatives each; ``echo``: the prompt's text in the answer;
    ``stop_token_ids`` ... ``bad_words``: the sampling controls, vLLM's, documented in
    ``disco.v1.SamplingParams``; ``structured``: a structured output's ``(kind, spec)``).

    Raises:
        DiscoRpcError: ``INVALID_ARGUMENT`` when a value does not fit its field.
    """
    try:
        sampling = common_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                             top_k=top_k, seed=seed, stop=list(stop), ignore_eos=ignore_eos,
                                             logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                             stop_token_ids=list(stop_token_ids), min_tokens=min_tokens,
                                             include_stop_str_in_output=include_stop_str_in_output,
                                             repetition_penalty=repetition_penalty,
                                             presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                             logit_bias=dict(logit_bias or {}), min_p=min_p,
                                             bad_words=list(bad_words),
                                             structured=None if structured is None else common_pb2.StructuredOutput(
                                                 kind=structured[0], spec=structured[1]))
        return orchestrator_pb2.GenerateRequest(prompt=prompt, prompt_ids=list(prompt_ids or ()), chat=chat,
                                                policy=policy, max_lookahead=max_lookahead, sampling=sampling,
                                                overlap=overlap, messages=[_message_pb(m) for m in messages],
                                                echo=echo, tools_json=json.dumps(list(tools)) if tools else "",
                                                continue_final_message=continue_final_message)
    except (TypeError, ValueError) as error:
        raise DiscoRpcError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {error}") from None


def completion_from_pb(message: orchestrator_pb2.GenerateResult) -> Completion:
    return Completion(token_ids=list(message.token_ids), text=message.text, finish_reason=message.finish_reason,
                      stats=stats_from_pb(message.stats).to_dict(), elapsed_ns=message.elapsed_ns,
                      logprobs=logprobs_from_pb(message.logprobs),
                      prompt_logprobs=logprobs_from_pb(message.prompt_logprobs), prompt_text=message.prompt_text)


def chunk_from_pb(message: orchestrator_pb2.GenerateChunk) -> Chunk:
    return Chunk(list(message.token_ids), message.text, message.elapsed_ns, logprobs=logprobs_from_pb(message.logprobs),
                 prompt_logprobs=logprobs_from_pb(message.prompt_logprobs), prompt_text=message.prompt_text)


def logprobs_from_pb(messages: Sequence[orchestrator_pb2.TokenLogprob]) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=m.token_id, token=m.token, logprob=m.logprob if m.HasField("logprob") else None,
                         rank=m.rank, top_logprobs=[TopLogprob(t.token_id, t.token, t.logprob) for t in m.top_logprobs])
            for m in messages]


def info_to_dict(message: orchestrator_pb2.InfoResponse) -> dict:
    """``Info`` as plain JSON-ready data (what ``disco info --json`` prints)."""
    return {
        "active_sessions": _fields(message.active_sessions),
        "version": message.version,
        "policies": [_fields(policy) for policy in message.policies],
        "models": {role: _fields(getattr(message, role)) if message.HasField(role) else None
                   for role in ("target", "draft")},
        "addresses": {"target": message.target_address, "draft": message.draft_address},
        "limits": _fields(message.limits),
        "errors": list(message.errors),
        "elapsed_ns": message.elapsed_ns,
    }


def _fields(message: Any) -> dict:
    values = {field.name: getattr(message, field.name) for field in message.DESCRIPTOR.fields}
    return {name: value if isinstance(value, (str, bytes, int, float, bool)) else list(value)
            for name, value in values.items()}


class GenerationStream:
    """Iterate it for :class:`Chunk` objects; ``result`` holds the :class:`Completion`
    once the stream ended. Leaving the loop early (or :meth:`cancel`) cancels the call,
    which frees the request's sessions on the servers."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.result: Completion | None = None

    def __iter__(self) -> Iterator[Chunk]:
        try:
            for message in self._call:
                if message.WhichOneof("event") == "chunk":
                    yield chunk_from_pb(message.chunk)
                else:
                    self.result = completion_from_pb(message.result)
        except grpc.RpcError as error:
            raise DiscoRpcError.wrap(error) from None
        finally:
            if self.result is None:
                self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


def client_tls(tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
               tls_server_name: str | None = None) -> TlsFiles | None:
    """TLS settings of a client (``None``: plaintext). ``tls_ca`` verifies the server (the
    system roots when only a client certificate is given); ``tls_cert``/``tls_key`` is a
    client certificate for servers that require one; ``tls_server_name`` overrides the
    name checked against the server's certificate."""
    if tls_server_name and not (tls_ca or tls_cert):
        return TlsFiles(server_name=tls_server_name)
    return TlsFiles.from_paths(tls_cert, tls_key, tls_ca, tls_server_name)


class DiscoClient:
    """Blocking client.

    Args:
        address: ``HOST:PORT`` of the orchestrator.
        timeout: deadline of each call in seconds (``None``: none).
        tls_ca, tls_cert, tls_key, tls_server_name: TLS, see :func:`client_tls` (plaintext without).
        auth_token: sent as ``authorization: Bearer <token>``; default ``$DISCO_AUTH_TOKEN``.
    """

    def __init__(self, address: str, timeout: float | None = DEFAULT_TIMEOUT_S, *, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_server_name: str | None = None,
                 auth_token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = secure_channel(address, client_tls(tls_ca, tls_cert, tls_key, tls_server_name),
                                       CHANNEL_OPTIONS)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)
        self._metadata = auth_metadata(auth_token_from_env(auth_token))

    def generate(self, prompt: str = "", **request: Any) -> Completion:
        """One completion, answered at once; ``request`` takes the arguments of :func:`build_request`."""
        try:
            return completion_from_pb(self._stub.GenerateUnary(build_request(prompt, **request), timeout=self.timeout,
                                                               metadata=self._metadata))
        except grpc.RpcError as error:
            raise DiscoRpcError.wrap(error) from None

    def stream(self, prompt: str = "", **request: Any) -> GenerationStream:
        """One completion, streamed; ``request`` takes the arguments of :func:`build_request`."""
        return GenerationStream(self._stub.Generate(build_request(prompt, **request), timeout=self.timeout,
                                                    metadata=self._metadata))

    def info(self) -> dict:
        """Capabilities and load of the deployment (see :func:`info_to_dict`)."""
        try:
            return info_to_dict(self._stub.Info(orchestrator_pb2.InfoRequest(), timeout=self.timeout,
                                                metadata=self._metadata))
        except grpc.RpcError as error:
            raise DiscoRpcError.wrap(error) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "DiscoClient":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


class AsyncGenerationStream:
    """``async for`` it for :class:`Chunk` objects; ``result`` holds the :class:`Completion`
    once the stream ended. Leaving the loop early (or :meth:`cancel`) cancels the call."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.result: Completion | None = None

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            async for message in self._call:
                if message.WhichOneof("event") == "chunk":
                    yield chunk_from_pb(message.chunk)
                else:
                    self.result = completion_from_pb(message.result)
        except grpc.RpcError as error:
            raise DiscoRpcError.wrap(error) from None
        finally:
            if self.result is None:
                self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()


class AsyncDiscoClient:
    """``grpc.aio`` client with the methods and arguments of :class:`DiscoClient`; create
    it inside the event loop."""

    def __init__(self, address: str, timeout: float | None = DEFAULT_TIMEOUT_S, *, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_server_name: str | None = None,
                 auth_token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = aio_channel(address, client_tls(tls_ca, tls_cert, tls_key, tls_server_name), CHANNEL_OPTIONS)
        self._stub = orchestrator_pb2_grpc.OrchestratorStub(self._channel)
        self._metadata = auth_metadata(auth_token_from_env(auth_token))

    async def generate(self, prompt: str = "", **request: Any) -> Completion:
        try:
            response = await self._stub.GenerateUnary(build_request(prompt, **request), timeout=self.timeout,
                                                      metadata=self._metadata)
        except grpc.RpcError as error:
            raise DiscoRpcError.wrap(error) from None
        return completion_from_pb(response)

    def stream(self, prompt: str = "", **request: Any) -> AsyncGenerationStream:
        return AsyncGenerationStream(self._stub.Generate(build_request(prompt, **request), timeout=self.timeout,
                                                         metadata=self._metadata))

    async def info(self) -> dict:
        try:
            return info_to_dict(await self._stub.Info(orchestrator_pb2.InfoRequest(), timeout=self.timeout,
                                                      metadata=self._metadata))
        except grpc.RpcError as error:
            raise DiscoRpcError.wrap(error) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncDiscoClient":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.close()


__all__ = ["AsyncDiscoClient", "Chunk", "Completion", "DiscoClient", "DiscoRpcError", "GenerationStream",
           "TokenLogprob", "TopLogprob"]
