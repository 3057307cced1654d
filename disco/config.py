"""Frozen configuration dataclasses, built once at an entry point and passed down."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace

from disco.errors import InvalidRequest

DEFAULT_MAX_LOOKAHEAD = 20
MAX_LOOKAHEAD_LIMIT = 64
#: The engines a model can run as; "int8" / "int4" are int8 / group-wise int4 weight-only
#: with bfloat16 activations.
ENGINE_DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")
#: The weight-only engines: their kernels are torch's CPU ops (``_weight_int8pack_mm``,
#: ``_weight_int4pack_mm_for_cpu``), so a CUDA device refuses them.
CPU_ONLY_DTYPES = ("int8", "int4")
#: Engines refused on a GPU, and why: exactness is the first promise, and these could not keep it
#: there (docs/engines.md, "Exactness on CUDA").
GPU_REFUSED_DTYPES = {
    "float16": "on an H200 its verified blocks gave logits up to 0.2 from decoding's (float16's range "
               "and rounding amplify the order of the sums), so speculative output would differ from "
               "target-only",
}
#: What ``--dtype`` accepts: an engine, or "auto" (bf16 on CUDA; on a CPU the candidate
#: engines timed on the machine: disco.engines.engine_choice).
DTYPE_CHOICES = ("auto", *ENGINE_DTYPES)
#: Stop strings a request may give, and the longest one (characters). OpenAI takes 4; 16
#: leaves room for chat templates' end markers while bounding the matcher's automaton
#: (at most 16 x 256 states, built per request; docs/operations.md, "Limits").
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
#: Seeds drawn for sampled requests that give none are below 2**53: the seed reported with
#: the request's stats is then exact as a JSON number in every client (JavaScript included),
#: so it can be sent back to reproduce the output.
RANDOM_SEED_BOUND = 2**53


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen and when generation ends.

    ``temperature == 0`` means greedy decoding (the default, as in ``disco generate``).
    With ``temperature > 0`` the target distribution is the model's softmax after
    temperature, top-k and top-p warping; speculative decoding preserves exactly that
    distribution, and the token at each position is a function of that distribution and
    noise keyed by ``(seed, position)`` alone (drafter-invariant speculative sampling, Daliri
    et al. 2024: :mod:`disco.speculation.sampling`): a seed gives the same text whatever the
    policy, lookahead, load and transport. A sampled request without a seed gets a random one
    (:meth:`seeded`), reported in its stats.

    Stop strings follow vLLM: the text is cut *before* the stop string, the token that
    completed it is the last token id returned. EOS tokens are returned in
    ``token_ids`` but not rendered in the text.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_new_tokens_limit: int | None = None) -> None:
        """Raise :class:`InvalidRequest` with a precise message if a field is out of range."""
        if self.max_new_tokens < 1:
            raise InvalidRequest(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if max_new_tokens_limit is not None and self.max_new_tokens > max_new_tokens_limit:
            raise InvalidRequest(
                f"max_new_tokens must be <= {max_new_tokens_limit} on this server, "
                f"got {self.max_new_tokens}"
            )
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequest(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop strings: {len(self.stop)} given, more than the limit of {MAX_STOP_STRINGS}")
        for index, stop in enumerate(self.stop):
            if not stop:
                raise InvalidRequest("stop strings must not be empty")
            if len(stop) > MAX_STOP_CHARS:
                raise InvalidRequest(f"stop strings must be at most {MAX_STOP_CHARS} characters long; "
                                     f"stop[{index}] has {len(stop)}")

    def seeded(self) -> "SamplingParams":
        """These params with a seed: unchanged when greedy or seeded, else with a random seed
        in ``[0, RANDOM_SEED_BOUND)`` (the caller reports it, so the output can be reproduced)."""
        if self.is_greedy or self.seed is not None:
            return self
        return replace(self, seed=secrets.randbelow(RANDOM_SEED_BOUND))

    def resumed_after(self, generated: int) -> "SamplingParams":
        """The params of a session re-created after ``generated`` tokens were committed
        (a lost session, a failed replica, a draft left behind under load): the remaining
        token budget, and the request's own seed. The sampling noise is keyed by (seed,
        absolute position) and a re-created session starts at the same absolute position
        (its prompt is the committed sequence), so it draws fresh noise for every later
        token and the text is the one the session would have given without the failure.
        """
        if generated <= 0:
            return self
        return replace(self, max_new_tokens=max(1, self.max_new_tokens - generated))


@dataclass(frozen=True)
class SpeculationConfig:
    """Per-request speculation settings: which stop policy, the lookahead cap, and whether
    the draft side pre-drafts during verification (overlap)."""

    policy: str = "auto"  # the default everywhere (CLI, services, client): see disco.speculation.policies.auto
    max_lookahead: int = DEFAULT_MAX_LOOKAHEAD
    overlap: bool | None = None  # overlapped drafting for this request; None: the draft service's setting

    def validate(self) -> None:
        if not 1 <= self.max_lookahead <= MAX_LOOKAHEAD_LIMIT:
            raise InvalidRequest(
                f"max_lookahead must be in [1, {MAX_LOOKAHEAD_LIMIT}], got {self.max_lookahead}"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Where a model comes from and how it runs.

    ``spec`` is a local HF folder, a hub id, or a ``.gguf`` file; ``None`` means the
    default pair (prepared offline from PyPI on first use, see :mod:`disco.models.default_pair`).
    """

    spec: str | None = None
    dtype: str = "bfloat16"  # a concrete engine (ENGINE_DTYPES); entry points resolve "auto" first
    device: str = "cpu"

    def validate(self) -> None:
        if self.dtype == "auto":
            raise InvalidRequest("dtype 'auto' must be resolved into a concrete dtype at the entry point "
                                 "(disco.platform.resolve_dtype) before a model is configured")
        if self.dtype not in ENGINE_DTYPES:
            raise InvalidRequest(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise InvalidRequest(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.dtype in CPU_ONLY_DTYPES and self.device != "cpu":
            raise InvalidRequest(f"the {self.dtype} engine runs on a CPU only (its kernels are torch's CPU "
                                 f"weight-only ops); on {self.device} use bfloat16 or float32")
        if self.dtype in GPU_REFUSED_DTYPES and self.device != "cpu":
            raise InvalidRequest(f"the {self.dtype} engine is refused on {self.device}: "
                                 f"{GPU_REFUSED_DTYPES[self.dtype]}; use bfloat16 (exact there) or float32")


@dataclass(frozen=True)
class PairConfig:
    """The target and draft models of one deployment."""

    target: ModelConfig = field(default_factory=ModelConfig)
    draft: ModelConfig = field(default_factory=ModelConfig)

    @property
    def engine(self) -> str:
        """The engines in words: ``"int8"``, or ``"int8, draft int4"`` where they differ."""
        if self.draft.dtype == self.target.dtype:
            return self.target.dtype
        return f"{self.target.dtype}, draft {self.draft.dtype}"
