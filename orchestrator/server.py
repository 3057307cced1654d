"""Start the public orchestrator (``disco orchestrator`` and Ray actors call this).

The orchestrator holds no model: only the target's tokenizer, and channels to the
draft and target services.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from disco.errors import ModelError
from disco.models import tokenizer_hash
from orchestrator.backends import Backends
from orchestrator.servicer import SERVICE_NAME, OrchestratorLimits, OrchestratorServicer
from protos.disco.v1 import orchestrator_pb2_grpc
from protos.runtime import RunningServer, start_server


def load_tokenizer(spec: str | None, home: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of the target model ``spec`` (an HF folder, a ``.gguf`` file, a hub
    id, or ``None`` for the default pair), without loading any weights.

    Raises:
        ModelError: the tokenizer cannot be found or read.
    """
    from disco.model_store import ensure_default_model  # noqa: PLC0415 - imports disco.models' converters
    from disco.models import convert_gguf  # noqa: PLC0415

    if spec is None:
        location = str(ensure_default_model("target", home))
    elif Path(spec).expanduser().is_file() and spec.endswith(".gguf"):
        location = str(convert_gguf(Path(spec).expanduser(), home))
    else:
        location = str(Path(spec).expanduser()) if Path(spec).expanduser().is_dir() else spec
    try:
        return AutoTokenizer.from_pretrained(location)
    except Exception as error:  # noqa: BLE001 -- NOTE: loaders raise anything (hub, json)
        reason = (str(error).strip() or type(error).__name__).splitlines()[0]
        raise ModelError(f"could not load the tokenizer of {spec or 'the default target'} "
                         f"from {location}: {reason}") from error


def serve(tokenizer: PreTrainedTokenizerBase, draft_address: str, target_address: str, *,
          host: str = "127.0.0.1", port: int = 0, limits: OrchestratorLimits = OrchestratorLimits()) -> RunningServer:
    """Start the public ``disco.v1.Orchestrator`` service; returns at once.

    The backends need not be up yet: each request reaches them when it runs (and gets
    ``UNAVAILABLE`` if it cannot).

    Args:
        tokenizer: the target model's tokenizer.
        draft_address: ``HOST:PORT`` of the draft service.
        target_address: ``HOST:PORT`` of the target service.
        host: interface to bind.
        port: port to bind; 0 picks a free one (read ``RunningServer.port``).
        limits: request limits.

    Raises:
        DiscoError: the address cannot be bound.
    """
    backends = Backends(draft_address, target_address, tokenizer_hash(tokenizer))
    servicer = OrchestratorServicer(tokenizer, backends, limits)
    # Each streaming request holds a thread for its duration; Info calls get spare ones.
    return start_server([(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, servicer, SERVICE_NAME)],
                        host, port, max_workers=limits.max_sessions + 8)
