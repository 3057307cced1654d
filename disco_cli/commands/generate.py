"""``disco generate``: one completion, in process (default) or through a server."""

from __future__ import annotations

import argparse
import json
import sys

from disco.config import DEFAULT_MAX_LOOKAHEAD, SamplingParams, SpeculationConfig, StructuredOutput
from disco.speculation.loop import GenerationResult, TokenChunk
from disco.speculation.policies import parse_policy_spec, reads_costs
from disco_cli.commands.common import (
    add_client_security_args,
    add_model_args,
    client_from_args,
    pair_config_from_args,
)

DEFAULT_POLICY = "auto"


def add_request_args(parser: argparse.ArgumentParser) -> None:
    """Flags describing one generation request (shared with the benchmark)."""
    parser.add_argument("--policy", default=DEFAULT_POLICY,
                        help=f"stop policy spec (default {DEFAULT_POLICY}; see `disco policies`)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    parser.add_argument("--max-lookahead", type=int, default=DEFAULT_MAX_LOOKAHEAD,
                        help=f"cap on draft tokens per iteration (default {DEFAULT_MAX_LOOKAHEAD})")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    controls = parser.add_argument_group("sampling controls (vLLM's; applied by the draft and the target alike)")
    controls.add_argument("--stop-token-id", type=int, action="append", default=[], dest="stop_token_ids",
                          help="token id that ends generation, as EOS does (repeatable)")
    controls.add_argument("--min-tokens", type=int, default=0, help="EOS and stop tokens banned until this many")
    controls.add_argument("--include-stop-str-in-output", action="store_true",
                          help="keep the stop string or stop token's text in the output")
    controls.add_argument("--repetition-penalty", type=float, default=1.0)
    controls.add_argument("--presence-penalty", type=float, default=0.0)
    controls.add_argument("--frequency-penalty", type=float, default=0.0)
    controls.add_argument("--min-p", type=float, default=0.0)
    controls.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                          help="add BIAS to token ID's logit (repeatable)")
    controls.add_argument("--bad-word", action="append", default=[], dest="bad_words",
                          help="a word never completed (repeatable)")
    structured = parser.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    structured.add_argument("--json-schema", default=None, metavar="SCHEMA",
                            help="the output is JSON valid under this schema (JSON text, or @FILE)")
    structured.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structured.add_argument("--regex", default=None, help="the whole output matches this regex")
    structured.add_argument("--choice", action="append", default=None,
                            help="the output is one of these strings (repeatable)")
    structured.add_argument("--grammar", default=None, metavar="LARK",
                            help="the output follows this Lark grammar (text, or @FILE)")


def _text_or_file(value: str) -> str:
    if value.startswith("@"):
        from pathlib import Path  # noqa: PLC0415

        return Path(value[1:]).read_text()
    return value


def structured_from_args(args: argparse.Namespace) -> StructuredOutput | None:
    if getattr(args, "json_schema", None) is not None:
        return StructuredOutput("json_schema", _text_or_file(args.json_schema))
    if getattr(args, "json_object", False):
        return StructuredOutput("json_object")
    if getattr(args, "regex", None) is not None:
        return StructuredOutput("regex", args.regex)
    if getattr(args, "choice", None):
        return StructuredOutput("choice", json.dumps(args.choice))
    if getattr(args, "grammar", None) is not None:
        return StructuredOutput("grammar", _text_or_file(args.grammar))
    return None


def _logit_bias(entries: list[str]) -> tuple[tuple[int, float], ...]:
    from disco.errors import InvalidRequest  # noqa: PLC0415

    pairs = []
    for entry in entries:
        token, _, bias = entry.partition("=")
        try:
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise InvalidRequest(f"--logit-bias takes ID=BIAS (e.g. 42=-100), got {entry!r}") from None
    return tuple(pairs)


def request_from_args(args: argparse.Namespace) -> tuple[SamplingParams, SpeculationConfig]:
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=tuple(args.stop),
                              ignore_eos=args.ignore_eos, stop_token_ids=tuple(args.stop_token_ids),
                              min_tokens=args.min_tokens, include_stop_str_in_output=args.include_stop_str_in_output,
                              repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, min_p=args.min_p,
                              logit_bias=_logit_bias(args.logit_bias), bad_words=tuple(args.bad_words),
                              structured=structured_from_args(args))
    speculation = SpeculationConfig(policy=args.policy, max_lookahead=args.max_lookahead)
    sampling.validate()
    speculation.validate()
    parse_policy_spec(speculation.policy)
    return sampling, speculation


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate one completion with speculative decoding")
    parser.add_argument("--prompt", required=True, help="prompt text (raw completion unless --chat)")
    parser.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    parser.add_argument("--overlap", choices=["off", "on"], default=None,
                        help="overlapped drafting: pre-draft the next block while the target verifies "
                             "(docs/overlap.md; default off in process; with --server it is sent with the request, "
                             "and absent the draft service's setting applies)")
    parser.add_argument("--json", action="store_true",
                        help="print exactly one JSON object {token_ids, text, stats} instead of streaming")
    parser.add_argument("--server", default=None, metavar="HOST:PORT",
                        help="send the request to a running orchestrator instead of loading models here")
    add_request_args(parser)
    add_model_args(parser)
    add_client_security_args(parser)
    parser.set_defaults(func=run)


def result_json(token_ids: list[int], text: str, stats: dict, finish_reason: str) -> str:
    return json.dumps({"token_ids": token_ids, "text": text, "finish_reason": finish_reason, "stats": stats})


def run(args: argparse.Namespace) -> int:
    sampling, speculation = request_from_args(args)
    if args.server:
        return _run_remote(args, sampling, speculation)
    from disco.engines.in_process import build_local_pipeline, encode_prompt  # noqa: PLC0415
    from disco.models.loading import disco_home  # noqa: PLC0415 - heavy imports only when needed

    if not args.prompt.strip():
        from disco.errors import InvalidRequest  # noqa: PLC0415
        raise InvalidRequest("prompt is empty")
    pair = pair_config_from_args(args)  # --dtype auto resolved: the stats line names the engine used
    pipeline = build_local_pipeline(pair, disco_home(), need_draft=parse_policy_spec(speculation.policy).uses_draft,
                                    measure_costs=reads_costs(speculation.policy), overlap=args.overlap == "on")
    prompt_ids = encode_prompt(pipeline.tokenizer, args.prompt, args.chat)
    result = None
    for event in pipeline.generator.stream(prompt_ids, sampling, speculation):
        if isinstance(event, TokenChunk) and not args.json:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, GenerationResult):
            result = event
    assert result is not None
    if args.json:
        print(result_json(result.token_ids, result.text, result.stats.to_dict(), result.finish_reason))
    else:
        print()
        print(f"[{speculation.policy} | {pair.engine}] {result.stats.summary_line()}", file=sys.stderr)
    return 0


def _run_remote(args: argparse.Namespace, sampling: SamplingParams, speculation: SpeculationConfig) -> int:
    import grpc  # noqa: PLC0415

    from orchestrator.client import DEFAULT_TIMEOUT_S  # noqa: PLC0415

    request = dict(policy=speculation.policy, max_new_tokens=sampling.max_new_tokens,
                   max_lookahead=speculation.max_lookahead, temperature=sampling.temperature,
                   top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed, stop=list(sampling.stop),
                   ignore_eos=sampling.ignore_eos, chat=args.chat,
                   overlap=None if args.overlap is None else args.overlap == "on",
                   stop_token_ids=list(sampling.stop_token_ids), min_tokens=sampling.min_tokens,
                   include_stop_str_in_output=sampling.include_stop_str_in_output,
                   repetition_penalty=sampling.repetition_penalty, presence_penalty=sampling.presence_penalty,
                   frequency_penalty=sampling.frequency_penalty, min_p=sampling.min_p,
                   logit_bias=dict(sampling.logit_bias), bad_words=list(sampling.bad_words),
                   structured=None if sampling.structured is None else (sampling.structured.kind,
                                                                          sampling.structured.spec))
    try:
        client = client_from_args(args, timeout=DEFAULT_TIMEOUT_S)
        if args.json:
            result = client.generate(args.prompt, **request)
            print(result_json(list(result.token_ids), result.text, result.stats, result.finish_reason))
            return 0
        stream = client.stream(args.prompt, **request)
        for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        print()
        from disco.stats import RequestStats  # noqa: PLC0415
        print(f"[{speculation.policy}] {RequestStats.from_dict(stream.result.stats).summary_line()}", file=sys.stderr)
        return 0
    except grpc.RpcError as error:
        print(f"{error.code().name}: {error.details()}", file=sys.stderr)
        return 1
