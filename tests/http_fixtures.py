"""The OpenAI-compatible gateway in front of real gRPC services on loopback (tiny models),
with a gRPC client and the official ``openai`` client.

Import the fixture into a test module (``from tests.http_fixtures import stack``); it is
module-scoped, so each module starts its own servers and stops them at the end.
"""

from __future__ import annotations

import copy

import openai
import pytest

import draft_service.server
import orchestrator.server
import target_service.server
from orchestrator.client import DiscoClient
from orchestrator.http.config import HttpConfig
from orchestrator.http.server import start_in_thread
from tests.grpc_fixtures import CLIENT_TIMEOUT_S, loaded
from tests.test_http_api import CHAT_TEMPLATE

#: The served model's name (the target's).
MODEL = "tiny-target"


class OpenAIStack:
    """Target, draft (the noisy copy) and orchestrator, the gateway, and both clients."""

    def __init__(self, target_model, draft_model, tokenizer):
        chat_tokenizer = copy.deepcopy(tokenizer)
        chat_tokenizer.chat_template = CHAT_TEMPLATE
        self.target = target_service.server.serve(loaded(target_model, tokenizer, MODEL))
        self.draft = draft_service.server.serve(loaded(draft_model, tokenizer, "tiny-noisy"))
        self.orch = orchestrator.server.serve(chat_tokenizer, self.draft.address, self.target.address)
        self.http = start_in_thread(HttpConfig(self.orch.address, port=0))
        self.grpc = DiscoClient(self.orch.address, timeout=CLIENT_TIMEOUT_S)
        self.openai = openai.OpenAI(base_url=self.http.url, api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)

    def close(self):
        self.grpc.close()
        self.http.stop()
        for server in (self.orch, self.draft, self.target):
            server.stop(0)


@pytest.fixture(scope="module")
def stack(target_model, drafts, tokenizer):
    running = OpenAIStack(target_model, drafts["noisy"], tokenizer)
    yield running
    running.close()
