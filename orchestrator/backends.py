"""The orchestrator's view of its two backends: one channel each (shared by all
requests), what they serve (fetched once, then cached), and the checks that a draft,
a target and the orchestrator's tokenizer belong together."""

from __future__ import annotations

import threading

import grpc

from disco.errors import ModelError, VocabularyMismatch
from orchestrator.remote import CallScope, RemoteDrafter, RemoteVerifier
from protos.disco.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc
from protos.runtime import CHANNEL_OPTIONS, error_from_rpc

DESCRIBE_TIMEOUT_S = 5.0


class Backends:
    """Channels to the draft and target services.

    Args:
        draft_address: ``HOST:PORT`` of the draft service.
        target_address: ``HOST:PORT`` of the target service.
        tokenizer_hash: hash of the orchestrator's tokenizer (:func:`disco.models.tokenizer_hash`);
            both services must serve models with this tokenizer.
    """

    def __init__(self, draft_address: str, target_address: str, tokenizer_hash: str) -> None:
        self.draft_address = draft_address
        self.target_address = target_address
        self.tokenizer_hash = tokenizer_hash
        self.draft_channel = grpc.insecure_channel(draft_address, options=CHANNEL_OPTIONS)
        self.target_channel = grpc.insecure_channel(target_address, options=CHANNEL_OPTIONS)
        self._draft_stub = draft_pb2_grpc.DraftServiceStub(self.draft_channel)
        self._target_stub = target_pb2_grpc.TargetServiceStub(self.target_channel)
        self._target_info: common_pb2.ServiceInfo | None = None
        self._draft_checked = False
        self._lock = threading.Lock()

    def drafter(self, scope: CallScope) -> RemoteDrafter:
        return RemoteDrafter(self.draft_channel, self.draft_address, scope)

    def verifier(self, scope: CallScope) -> RemoteVerifier:
        return RemoteVerifier(self.target_channel, self.target_address, scope)

    def describe(self, role: str, timeout: float = DESCRIBE_TIMEOUT_S) -> common_pb2.ServiceInfo:
        """The ``Info`` of the ``"draft"`` or ``"target"`` service.

        Raises:
            Unavailable: the service cannot be reached.
        """
        stub = self._draft_stub if role == "draft" else self._target_stub
        address = self.draft_address if role == "draft" else self.target_address
        try:
            return stub.Info(common_pb2.ServiceInfoRequest(), timeout=timeout)
        except grpc.RpcError as error:
            raise error_from_rpc(error, f"{role} service at {address}") from None

    def target_info(self) -> common_pb2.ServiceInfo:
        """The target's ``Info`` (cached after the first success); its EOS ids are authoritative.

        Raises:
            Unavailable: the target cannot be reached.
            ModelError: the target's tokenizer differs from the orchestrator's.
        """
        with self._lock:
            if self._target_info is None:
                info = self.describe("target")
                if info.tokenizer_hash != self.tokenizer_hash:
                    raise ModelError(
                        f"the target service at {self.target_address} serves {info.model_name!r}, whose tokenizer "
                        "differs from the orchestrator's; start the orchestrator with --model set to the target model")
                self._target_info = info
            return self._target_info

    def check_draft(self) -> None:
        """Check once that the draft shares the target's tokenizer.

        Raises:
            Unavailable: the draft cannot be reached.
            VocabularyMismatch: its tokenizer differs.
        """
        with self._lock:
            if self._draft_checked:
                return
            info = self.describe("draft")
            if info.tokenizer_hash != self.tokenizer_hash:
                raise VocabularyMismatch(
                    f"the draft service at {self.draft_address} serves {info.model_name!r}, which does not share "
                    "the target's tokenizer; speculative decoding needs one vocabulary")
            self._draft_checked = True

    def close(self) -> None:
        self.draft_channel.close()
        self.target_channel.close()
