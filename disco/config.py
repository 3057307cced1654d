"""Frozen configuration dataclasses, built once at an entry point and passed down."""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field, replace

from disco.errors import InvalidRequest

DEFAULT_MAX_LOOKAHEAD = 20
MAX_LOOKAHEAD_LIMIT = 64
#: The smallest draft prefill window (its first 4 tokens, the attention sinks, and at least 4 more).
MIN_PREFILL_WINDOW = 8
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
#: Budgets of the sampling controls (this server's bounds; docs/exactness.md, "Sampling controls"):
#: each is checked before any work, so a request cannot make the engines build large masks.
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_LIMIT = 100.0  # |bias| (OpenAI's and vLLM's range)
MAX_BAD_WORDS = 64  # words; each gives at most two token sequences (with and without a leading space)
MAX_BAD_WORD_TOKENS = 32  # tokens of one bad word's sequence
MAX_EOS_TOKEN_IDS = 16
PENALTY_LIMIT = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's and vLLM's range)
#: Most likely alternatives a request may ask for per position (``logprobs``, ``prompt_logprobs``):
#: OpenAI's completions take 5 and its chat 20, vLLM its ``--max-logprobs`` (20 by default).
MAX_LOGPROBS = 20
#: Log-probability entries (a position's own token and each alternative count one) a request may
#: ask for in all: ``(max_new_tokens x (logprobs + 1)) + (prompt tokens x (prompt_logprobs + 1))``.
#: Checked before any work; it bounds the response (about 20 bytes an entry on the wire, so a
#: whole result stays far below the 64 MiB the project's clients accept: orchestrator.client).
MAX_LOGPROB_ENTRIES = 1 << 18
#: Structured outputs (disco.speculation.grammar): the kinds of constraint, the longest
#: specification (characters: a JSON schema, a regex, a grammar, the choices as a JSON array)
#: and the most choices. Checked before any work; the grammar engine's own limits bound the rest.
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_calls")
#: Tools a ``tool_calls`` constraint may name (OpenAI allows 128).
MAX_TOOLS = 128
MAX_STRUCTURED_CHARS = 65536
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output: the draft and the target mask every token the constraint
    does not allow, so speculative output equals target-only constrained decoding.

    ``kind`` and ``spec``: ``json_schema`` (the schema as JSON text), ``json_object`` (any JSON
    object; ``spec`` empty), ``regex`` (the whole output matches it), ``choice`` (the output is
    one of the strings of the JSON array ``spec``), ``grammar`` (a Lark grammar, llguidance's
    dialect), ``tool_calls`` (one or more tool calls in the Qwen2.5 / Hermes format,
    ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``; ``spec``:
    ``{"tools": [{"name": ..., "parameters": {JSON schema}}, ...], "parallel": bool}``)."""

    kind: str
    spec: str = ""

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequest(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                 f"got {self.kind!r}")
        if len(self.spec) > MAX_STRUCTURED_CHARS:
            raise InvalidRequest(f"structured output ({self.kind}): the specification has {len(self.spec)} "
                                 f"characters, more than the limit of {MAX_STRUCTURED_CHARS}")
        if self.kind == "json_object":
            if self.spec:
                raise InvalidRequest("structured output (json_object) takes no specification")
            return
        if not self.spec:
            raise InvalidRequest(f"structured output ({self.kind}) needs a specification")
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.spec)
            except ValueError as error:
                raise InvalidRequest(f"structured output ({self.kind}) is not valid JSON: {error}") from None
            if self.kind == "json_schema" and not isinstance(value, (dict, bool)):
                raise InvalidRequest("structured output (json_schema): the schema must be a JSON object")
            if self.kind == "choice" and (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                                          or not all(isinstance(item, str) and item for item in value)):
                raise InvalidRequest(f"structured output (choice): expected a list of 1 to {MAX_CHOICES} "
                                     "non-empty strings")
        if self.kind == "tool_calls":
            _check_tool_calls_spec(self.spec)


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
    # Sampling controls, applied by the draft and the target alike with vLLM's semantics, in
    # vLLM's order (disco.speculation.logits_processors; docs/exactness.md, "Sampling controls").
    stop_token_ids: tuple[int, ...] = ()  # end generation (returned in token_ids, not in the text)
    min_tokens: int = 0  # EOS and stop_token_ids banned (and stop strings not honored) until this many
    include_stop_str_in_output: bool = False  # the text keeps the stop string / stop token's text
    repetition_penalty: float = 1.0  # over prompt + output tokens: logit / p if > 0 else logit * p
    presence_penalty: float = 0.0  # over output tokens: minus p once a token occurred
    frequency_penalty: float = 0.0  # over output tokens: minus p times its count
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), ids unique
    min_p: float = 0.0  # after temperature: drop tokens below min_p x the top token's probability
    bad_words: tuple[str, ...] = ()  # words never completed; tokenized by the loop into bad_words_token_ids
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # the last token banned where the rest precede it
    # Set by the loop for its sessions, not by clients: the EOS ids that min_tokens bans (with
    # stop_token_ids), and how many of the session's trailing prompt tokens are output already (a
    # session re-created after a failure: resumed_after), which the output-token controls count.
    eos_token_ids: tuple[int, ...] = ()
    resumed_tokens: int = 0
    # The target's log-probabilities (raw: log_softmax of its logits before temperature and every
    # control; disco.speculation.logprobs), computed only when asked. None: not asked.
    logprobs: int | None = None  # of each generated token, and its this many most likely alternatives
    prompt_logprobs: int | None = None  # of each prompt token after the first, likewise (prefill)
    # A constraint on the output (JSON schema, regex, choice, grammar), masked by draft and target alike.
    structured: StructuredOutput | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_logits_controls(self) -> bool:
        """Whether any history-dependent control changes the logits (min_p aside, which warps
        them with temperature, top-k and top-p): when none does, the engines skip them at no cost."""
        return bool(self.structured is not None or self.bad_words_token_ids or self.logit_bias
                    or self.repetition_penalty != 1.0
                    or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                    or (self.min_tokens > 0 and (self.stop_token_ids or self.eos_token_ids)))

    def validate(self, max_new_tokens_limit: int | None = None) -> None:
        """Raise :class:`InvalidRequest` with a precise message if a field is out of range."""
        if self.max_new_tokens < (0 if self.prompt_logprobs is not None else 1):  # 0: prompt scoring
            raise InvalidRequest(f"max_new_tokens must be >= 1 (0 only with prompt_logprobs), "
                                 f"got {self.max_new_tokens}")
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}] on this server, got {value}")
        self._validate_controls()
        if self.structured is not None:
            self.structured.validate()
            # The grammar ends the output with EOS: refused rather than generating past its end.
            if self.ignore_eos:
                raise InvalidRequest("ignore_eos cannot be combined with a structured output (the grammar's end "
                                     "is an EOS token)")
            if self.min_tokens:
                raise InvalidRequest("min_tokens cannot be combined with a structured output (it bans the EOS "
                                     "token the grammar may require)")

    def _validate_controls(self) -> None:
        """The sampling controls' ranges and budgets (vocabulary bounds: :meth:`check_token_ids`)."""
        _check_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        _check_ids("eos_token_ids", self.eos_token_ids, MAX_EOS_TOKEN_IDS)
        if self.resumed_tokens < 0:
            raise InvalidRequest(f"resumed_tokens must be >= 0, got {self.resumed_tokens}")
        budget = self.max_new_tokens + self.resumed_tokens  # the request's own max_new_tokens
        if not 0 <= self.min_tokens <= budget:
            raise InvalidRequest(f"min_tokens must be in [0, max_new_tokens = {budget}], got {self.min_tokens}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty must be a finite number > 0 (1 disables it), "
                                 f"got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or abs(value) > PENALTY_LIMIT:
                raise InvalidRequest(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias: {len(self.logit_bias)} entries, more than the limit of {MAX_LOGIT_BIAS}")
        _check_ids("logit_bias", [token for token, _ in self.logit_bias], MAX_LOGIT_BIAS)
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidRequest("logit_bias: a token id appears twice")
        for token, bias in self.logit_bias:
            if not math.isfinite(bias) or abs(bias) > LOGIT_BIAS_LIMIT:
                raise InvalidRequest(f"logit_bias: the bias of token {token} must be in "
                                     f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias}")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequest(f"bad_words: {len(self.bad_words)} given, more than the limit of {MAX_BAD_WORDS}")
        for index, word in enumerate(self.bad_words):
            if not word.strip():
                raise InvalidRequest(f"bad_words[{index}] is empty")
            if len(word) > MAX_STOP_CHARS:
                raise InvalidRequest(f"bad_words must be at most {MAX_STOP_CHARS} characters long; "
                                     f"bad_words[{index}] has {len(word)}")
        if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise InvalidRequest(f"bad_words_token_ids: {len(self.bad_words_token_ids)} sequences, more than the "
                                 f"limit of {2 * MAX_BAD_WORDS}")
        for index, sequence in enumerate(self.bad_words_token_ids):
            if not sequence:
                raise InvalidRequest(f"bad_words_token_ids[{index}] is empty")
            _check_ids(f"bad_words_token_ids[{index}]", sequence, MAX_BAD_WORD_TOKENS)

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise :class:`InvalidRequest` naming the field if a control's token id is outside the
        model's vocabulary ``[0, vocab_size)`` (the engines and the orchestrator call it before work)."""
        fields = {"stop_token_ids": self.stop_token_ids, "eos_token_ids": self.eos_token_ids,
                  "logit_bias": [token for token, _ in self.logit_bias],
                  "bad_words_token_ids": [token for sequence in self.bad_words_token_ids for token in sequence]}
        for name, ids in fields.items():
            outside = [token for token in ids if not 0 <= token < vocab_size]
            if outside:
                raise InvalidRequest(f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab_size})")

    def check_logprob_entries(self, prompt_tokens: int) -> None:
        """Refuse a request whose log-probabilities (:data:`MAX_LOGPROB_ENTRIES`) would be too
        many for one response, before any work is done.

        Raises:
            InvalidRequest: naming the fields and the limit.
        """
        entries = 0
        if self.logprobs is not None:
            entries += self.max_new_tokens * (self.logprobs + 1)
        if self.prompt_logprobs is not None:
            entries += prompt_tokens * (self.prompt_logprobs + 1)
        if entries > MAX_LOGPROB_ENTRIES:
            raise InvalidRequest(f"logprobs / prompt_logprobs: (max_new_tokens x (logprobs + 1)) + (prompt tokens x "
                                 f"(prompt_logprobs + 1)) is {entries}, more than the limit of "
                                 f"{MAX_LOGPROB_ENTRIES} on this server; ask for fewer")

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
        # The committed output becomes the end of the new session's prompt: resumed_tokens says
        # how much of it is output, so the controls that count output tokens (min_tokens, the
        # presence / frequency penalties, bad words) see the same history as before the failure.
        # The prompt's logprobs were returned with the first session: a re-created one skips them.
        return replace(self, max_new_tokens=max(1, self.max_new_tokens - generated),
                       resumed_tokens=self.resumed_tokens + generated, prompt_logprobs=None)


def _check_tool_calls_spec(spec: str) -> None:
    try:
        value = json.loads(spec)
    except ValueError as error:
        raise InvalidRequest(f"structured output (tool_calls) is not valid JSON: {error}") from None
    tools = value.get("tools") if isinstance(value, dict) else None
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise InvalidRequest(f"structured output (tool_calls): expected {{\"tools\": [1 to {MAX_TOOLS} tools], "
                             "\"parallel\": bool}")
    for index, tool in enumerate(tools):
        if (not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]
                or not isinstance(tool.get("parameters", {}), dict)):
            raise InvalidRequest(f"structured output (tool_calls): tools[{index}] needs a name and "
                                 "parameters (a JSON schema object)")
    if not isinstance(value.get("parallel", False), bool):
        raise InvalidRequest("structured output (tool_calls): parallel must be true or false")


def _check_ids(name: str, ids, limit: int) -> None:
    """A list of token ids: at most ``limit``, each a non-negative integer."""
    if len(ids) > limit:
        raise InvalidRequest(f"{name}: {len(ids)} token ids, more than the limit of {limit}")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequest(f"{name}: token ids must be integers >= 0, got {token!r}")


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
    vocab_subset: int = 0  # a draft's LM head over its N most frequent tokens (disco.models.vocab_subset); 0: all
    prefill_window: int = 0  # a draft reads at most N prompt tokens (disco.engines.kv.prefill_window_skip); 0: all


    def validate(self) -> None:
        if self.dtype == "auto":
            raise InvalidRequest("dtype 'auto' must be resolved into a concrete dtype at the entry point "
                                 "(disco.platform.resolve_dtype) before a model is configured")
        if self.dtype not in ENGINE_DTYPES:
            raise InvalidRequest(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise InvalidRequest(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.vocab_subset < 0:
            raise InvalidRequest(f"a draft's vocabulary subset must be a number of tokens (0: all), "
                                 f"got {self.vocab_subset}")
        if self.prefill_window and self.prefill_window < MIN_PREFILL_WINDOW:
            raise InvalidRequest(f"a draft's prefill window must hold at least {MIN_PREFILL_WINDOW} prompt tokens "
                                 f"(0: the whole prompt), got {self.prefill_window}")
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
