"""Structured outputs and tool calls on the real pair (issue 48, items 5 and 6): validity, and
tokens/s of constrained decoding under ``auto`` (and ``static:3``) against ``none``.

The local pipeline ``disco generate`` builds (default pair, ``--dtype auto`` engines, measured
costs for ``auto``), greedy, chat prompts through Qwen2.5's own chat template; the policies are
interleaved per request. Each request is checked: JSON answers parse and validate against their
schema, tool calls parse (the Hermes format the template teaches) and their arguments validate
against the tool's parameters, and every policy's tokens equal ``none``'s::

    python docs/bench/structured/real_pair_check.py --json-out docs/bench/structured/epyc_real_pair.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time

import jsonschema
import torch

from disco.config import ModelConfig, PairConfig, SamplingParams, SpeculationConfig, StructuredOutput
from disco.engines.engine_choice import choose_engine
from disco.engines.in_process import build_local_pipeline, encode_conversation
from disco.models.loading import disco_home
from orchestrator.tools import parse_tool_calls, tool_calls_constraint

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    "employed": {"type": "boolean"}}, "required": ["name", "age", "languages", "employed"],
    "additionalProperties": False}
FUNCTION = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "arguments": {"type": "array", "items": {"type": "string"},
                                                                "maxItems": 6},
    "returns": {"enum": ["int", "str", "list", "dict", "bool", "None"]}},
    "required": ["name", "arguments", "returns"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                   "required": ["city", "unit", "days"], "additionalProperties": False}}}
RUN_TESTS = {"type": "function", "function": {
    "name": "run_tests", "description": "Run a project's test suite.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "verbose": {"type": "boolean"}},
                   "required": ["path"], "additionalProperties": False}}}
TOOLS = [WEATHER, RUN_TESTS]
REQUESTS = [
    ("json_schema", "Describe a fictional senior Python developer as JSON.", PERSON, None),
    ("json_schema", "Describe the signature of Python's built-in function `sorted` as JSON.", FUNCTION, None),
    ("json_schema", "Describe a fictional retired teacher from Lyon as JSON.", PERSON, None),
    ("tool_named", "What will the weather be like in Oslo over the next three days?", None, "get_weather"),
    ("tool_required", "Please run the tests in ./src with verbose output.", None, None),
    ("tool_auto", "What's the weather in Paris this week, in celsius?", None, "auto"),
]


def build(kind: str, schema: dict | None, tool: str | None) -> tuple[StructuredOutput | None, list | None]:
    if kind == "json_schema":
        return StructuredOutput("json_schema", json.dumps(schema)), None
    if tool == "auto":
        return None, TOOLS
    return StructuredOutput(*tool_calls_constraint(TOOLS, tool, False)), TOOLS


def check(kind: str, text: str, schema: dict | None) -> str:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), schema)
        return "valid JSON under the schema"
    content, calls = parse_tool_calls(text, "check")
    if not calls:
        return f"no tool call (content {content[:60]!r})"
    for call in calls:
        parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.name]
        jsonschema.validate(json.loads(call.arguments), parameters)
    return f"{len(calls)} valid call(s): " + ", ".join(f"{c.name}({c.arguments})" for c in calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policies", default="none,auto,static:3")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--json-out", required=True)
    args = parser.parse_args()
    home = disco_home()
    pair = PairConfig(target=ModelConfig(dtype=choose_engine("auto", None, "target", "cpu", home)),
                      draft=ModelConfig(dtype=choose_engine("auto", None, "draft", "cpu", home)))
    pipeline = build_local_pipeline(pair, home, measure_costs=True)
    generator, tokenizer = pipeline.generator, pipeline.tokenizer
    policies = args.policies.split(",")
    rows = []
    for index, (kind, question, schema, tool) in enumerate(REQUESTS):
        structured, tools = build(kind, schema, tool)
        ids = encode_conversation(tokenizer, [{"role": "user", "content": question}], tools)
        outputs = {}
        for policy in policies:
            sampling = SamplingParams(max_new_tokens=args.max_new_tokens, structured=structured)
            started = time.perf_counter()
            result = generator.generate(ids, sampling, SpeculationConfig(policy=policy))
            wall = time.perf_counter() - started
            outputs[policy] = result.token_ids
            try:
                verdict = check(kind, result.text, schema)
            except (ValueError, jsonschema.ValidationError) as error:
                verdict = f"INVALID: {str(error).splitlines()[0]}"
            rows.append({"request": index, "kind": kind, "policy": policy, "tokens": len(result.token_ids),
                         "finish_reason": result.finish_reason, "wall_s": round(wall, 3),
                         "tokens_per_s": round(len(result.token_ids) / wall, 3),
                         "draft_tokens": result.stats.draft_tokens, "accepted_tokens": result.stats.accepted_tokens,
                         "identical_to_none": result.token_ids == outputs[policies[0]], "check": verdict,
                         "text": result.text})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "text"}), flush=True)
    summary = {}
    for policy in policies:
        picked = [row for row in rows if row["policy"] == policy]
        tokens, wall = sum(r["tokens"] for r in picked), sum(r["wall_s"] for r in picked)
        drafted, accepted = sum(r["draft_tokens"] for r in picked), sum(r["accepted_tokens"] for r in picked)
        summary[policy] = {"tokens_per_s": round(tokens / wall, 3), "tokens": tokens,
                           "acceptance": round(accepted / drafted, 4) if drafted else None,
                           "identical_to_none": f"{sum(r['identical_to_none'] for r in picked)}/{len(picked)}",
                           "valid": f"{sum(not r['check'].startswith(('INVALID', 'no tool')) for r in picked)}"
                                    f"/{len(picked)}"}
    base = summary[policies[0]]["tokens_per_s"]
    for policy in policies:
        summary[policy]["ratio_to_none"] = round(summary[policy]["tokens_per_s"] / base, 3)
    print(json.dumps(summary, indent=1))
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    with open(args.json_out, "w") as out:
        json.dump({"machine": model, "platform": platform.platform(), "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "commit": commit, "engines": f"{pair.target.dtype} / {pair.draft.dtype}",
                   "date": time.strftime("%Y-%m-%d"), "summary": summary, "rows": rows}, out, indent=1)
        out.write("\n")


if __name__ == "__main__":
    main()
