"""Real gRPC servers on loopback (port 0) around the tiny test models.

Import the fixtures into a test module (``from tests.grpc_fixtures import grpc_stacks``);
they are module-scoped, so each module starts its own servers and stops them at the end.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import pytest

import draft_service.server
import orchestrator.server
import target_service.server
from disco.models.loading import LoadedModel, tokenizer_hash
from orchestrator.client import DiscoClient
from orchestrator.servicer import OrchestratorLimits
from protos.runtime.server import RunningServer
from tests.helpers import EOS_ID

DRAFT_KINDS = ("random", "same", "noisy")
CLIENT_TIMEOUT_S = 60.0  # no test may hang: every call has a deadline


def loaded(model, tokenizer, name: str) -> LoadedModel:
    """A tiny in-memory model described as :func:`disco.models.loading.load_model` would."""
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, fingerprint=name,
                       tokenizer_hash=tokenizer_hash(tokenizer), vocab_size=int(model.config.vocab_size),
                       eos_token_ids=(EOS_ID,))


@dataclass
class GrpcStack:
    """One orchestrator with its draft and target services, and a client of it."""

    orchestrator: RunningServer
    draft: RunningServer
    target: RunningServer
    client: DiscoClient

    def active_sessions(self) -> dict[str, int]:
        return {"orchestrator": self.orchestrator.servicers[0].active_sessions,
                "draft": self.draft.servicers[0].engine.active_sessions(),
                "target": self.target.servicers[0].engine.active_sessions()}

    def wait_idle(self, timeout_s: float = 5.0) -> dict[str, int]:
        """Poll until no service holds a session (or the timeout); returns the last counts."""
        deadline = time.monotonic() + timeout_s
        while True:
            counts = self.active_sessions()
            if not any(counts.values()) or time.monotonic() > deadline:
                return counts
            time.sleep(0.02)


def start_orchestrator(tokenizer, draft_address: str, target_address: str,
                       limits: OrchestratorLimits = OrchestratorLimits()) -> RunningServer:
    return orchestrator.server.serve(tokenizer, draft_address, target_address, limits=limits)


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def grpc_stacks(target_model, drafts, tokenizer):
    """``{draft kind: GrpcStack}`` sharing one target service."""
    target = target_service.server.serve(loaded(target_model, tokenizer, "tiny-target"))
    stacks = {}
    for kind in DRAFT_KINDS:
        draft = draft_service.server.serve(loaded(drafts[kind], tokenizer, f"tiny-{kind}"))
        orch = start_orchestrator(tokenizer, draft.address, target.address)
        stacks[kind] = GrpcStack(orch, draft, target, DiscoClient(orch.address, timeout=CLIENT_TIMEOUT_S))
    yield stacks
    for stack in stacks.values():
        stack.client.close()
        stack.orchestrator.stop(0)
        stack.draft.stop(0)
    target.stop(0)
