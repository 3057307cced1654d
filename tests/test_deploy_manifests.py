"""The KubeRay manifests in deploy/kuberay/ validate against the KubeRay CRDs, strictly
(an unknown field is an error, as with ``kubectl apply --validate=strict``), and the
pieces fit together: the RayJob targets the RayCluster, the commands parse with the
``disco`` CLI, the orchestrator's Service and gRPC probes point at its gRPC port (and the
Service at its HTTP port).

NOTE: the CRDs' ``x-kubernetes-validations`` (CEL) rules are not evaluated; they only
constrain fields these manifests do not use (managedBy, deletionStrategy, GCS FT).
"""

import copy
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")

from disco_cli.main import build_parser  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = REPO / "deploy" / "kuberay"
#: In-repo copies first (CI from a clean clone), then the shared data folder.
CRD_DIRS = (MANIFESTS / "crds", REPO.parent / "shared" / "data" / "kuberay")
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml",
             "RayService": "ray.io_rayservices.yaml"}


def documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted(MANIFESTS.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def by_kind(kind: str) -> dict:
    (doc,) = [doc for _, doc in documents() if doc["kind"] == kind]
    return doc


def strict(schema):
    """The schema with unknown fields forbidden wherever the API server would reject
    them (objects with declared properties and no free-form or preserved fields)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: strict(value) for key, value in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        schema["additionalProperties"] = False
    return schema


@pytest.fixture(scope="module")
def validators() -> dict:
    """``{(apiVersion, kind): validator}`` for the kinds the manifests use."""
    folder = next((d for d in CRD_DIRS if (d / CRD_FILES["RayCluster"]).is_file()), None)
    if folder is None:
        pytest.skip(f"no KubeRay CRDs in {' or '.join(map(str, CRD_DIRS))}")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are megabytes of YAML
    result = {}
    for kind in sorted({doc["kind"] for _, doc in documents()} & set(CRD_FILES)):
        crd = yaml.load((folder / CRD_FILES[kind]).read_text(), Loader=loader)
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            result[(f"{crd['spec']['group']}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return result


def errors(validators: dict, doc: dict) -> list[str]:
    validator = validators[(doc["apiVersion"], doc["kind"])]
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_every_kuberay_document_validates_against_its_crd(validators):
    checked = []
    for name, doc in documents():
        if doc["apiVersion"].startswith("ray.io/"):
            assert errors(validators, doc) == [], name
            checked.append(doc["kind"])
    assert sorted(checked) == ["RayCluster", "RayJob"]


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c["spec"]["headGroupSpec"].update(rayStartParam={}), "rayStartParam"),  # typo: unknown field
    (lambda c: c["spec"]["workerGroupSpecs"][0].update(replicas="two"), "'two' is not of type 'integer'"),
    (lambda c: c["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}), "0 is not of type 'string'"),
    (lambda c: c["spec"]["workerGroupSpecs"][0].pop("groupName"), "'groupName' is a required property"),
])
def test_a_broken_manifest_fails_validation(validators, mutate, message):
    cluster = copy.deepcopy(by_kind("RayCluster"))
    mutate(cluster)
    assert any(message in error for error in errors(validators, cluster))


def test_the_gpu_workers_request_gpus_and_the_head_runs_no_services():
    cluster = by_kind("RayCluster")
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    groups = {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"target", "draft"}  # one worker group per role, as tests/test_ray_multinode.py runs
    for role, group in groups.items():
        (container,) = group["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert group["replicas"] >= 2  # one pod serving, one spare for a lost node's replica
        advertised = json.loads(json.loads(group["rayStartParams"]["resources"]))  # KubeRay's quoted JSON
        assert advertised == {f"disco_{role}": 1}
        anti = group["template"]["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti[0]["labelSelector"]["matchLabels"] == {"disco.dev/role": "gpu-worker"}  # one pod per node, both groups
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert f"ARG RAY_VERSION={cluster['spec']['rayVersion']}" in dockerfile  # image and cluster agree


def test_the_rayjob_runs_disco_up_on_the_cluster():
    cluster, job = by_kind("RayCluster"), by_kind("RayJob")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["disco", "up"]
    args = build_parser().parse_args(argv[1:])  # every flag exists
    assert args.address == "auto" and args.no_orchestrator and args.placement == "spread"
    groups = {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}
    for role in ("target", "draft"):  # each role asks for the resource its worker group advertises
        (name,) = json.loads(json.loads(groups[role]["rayStartParams"]["resources"]))
        assert getattr(args, f"{role}_resource") == [f"{name}=1"]


def test_the_orchestrator_service_and_grpc_probes_point_at_its_grpc_and_http_ports():
    cluster, deployment, service = by_kind("RayCluster"), by_kind("Deployment"), by_kind("Service")
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    args = build_parser().parse_args(container["command"][1:])
    assert container["command"][:2] == ["disco", "ray-orchestrator"] and args.host == "0.0.0.0"
    # The Ray Client address is the head Service KubeRay creates, on the head's client port.
    head_ports = {p["name"]: p["containerPort"]
                  for p in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert args.address == f"ray://{cluster['metadata']['name']}-head-svc:{head_ports['client']}"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == args.port
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == args.port, probe
    assert container["readinessProbe"]["grpc"]["service"] == "disco.v1.Orchestrator"
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    service_ports = {port["name"]: port for port in service["spec"]["ports"]}
    assert set(service_ports) == {"grpc", "http"}
    assert service_ports["grpc"]["targetPort"] == "grpc" and service_ports["grpc"]["port"] == args.port
    # The OpenAI-compatible HTTP API (docs/http.md) on its own named port.
    assert ports["http"] == args.http_port and service_ports["http"]["targetPort"] == "http"


def test_every_volume_claim_is_declared():
    claims = {doc["metadata"]["name"] for _, doc in documents() if doc["kind"] == "PersistentVolumeClaim"}
    used = set(re.findall(r"claimName: (\S+)", "".join(p.read_text() for p in MANIFESTS.glob("*.yaml"))))
    assert used and used <= claims
