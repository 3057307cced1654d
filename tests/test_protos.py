"""The wire contract: committed generated code matches the protos, every element of the
contract is documented, and the generated modules import by their package path."""

import importlib
import re

from protos import generate

#: A field, or the start of an rpc, message, service or oneof.
DECLARATION = re.compile(r"^\s*(?:(?:optional|repeated)\s+)?[\w.]+\s+\w+\s*=\s*\d+\s*;"
                         r"|^\s*(?:rpc|message|service|oneof)\s")


def test_committed_generated_code_matches_the_protos(tmp_path):
    fresh = generate.generate(tmp_path)
    committed = generate.generated_files()
    relative = lambda paths, root: sorted(str(p.relative_to(root)) for p in paths)  # noqa: E731
    assert relative(fresh, tmp_path) == relative(committed, generate.ROOT)
    stale = [str(path.relative_to(tmp_path)) for path in fresh
             if path.read_bytes() != (generate.ROOT / path.relative_to(tmp_path)).read_bytes()]
    assert not stale, f"generated code is out of date, run `python -m protos.generate`: {stale}"


def test_every_field_message_and_rpc_is_documented():
    undocumented = []
    for path in generate.proto_files():
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if DECLARATION.match(line) and not lines[number - 1].strip().startswith("//"):
                undocumented.append(f"{path.name}:{number + 1}: {line.strip()}")
    assert not undocumented, "undocumented proto elements:\n" + "\n".join(undocumented)


def test_generated_modules_import_by_package_path():
    for path in generate.proto_files():
        module = importlib.import_module(f"protos.disco.v1.{path.stem}_pb2")
        assert module.DESCRIPTOR.package == "disco.v1"
        importlib.import_module(f"protos.disco.v1.{path.stem}_pb2_grpc")
    services = {name for path in generate.proto_files()
                for name in importlib.import_module(f"protos.disco.v1.{path.stem}_pb2").DESCRIPTOR.services_by_name}
    assert services == {"DraftService", "TargetService", "Orchestrator"}
