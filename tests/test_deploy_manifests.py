"""The KubeRay manifests in deploy/kuberay/ validate against the KubeRay CRDs, strictly
(an unknown field is an error, as with ``kubectl apply --validate=strict``), and the
pieces fit together: the deployer Job reaches the RayCluster's Ray Client port, the
commands parse with the ``disco`` CLI, the orchestrator's Service points at its gRPC and
HTTP ports. And they are secure by default (issue 45): every credential from a Secret
(``secretKeyRef`` or a read-only secret volume, no literal), Ray token authentication,
no dashboard on 0.0.0.0, a default-deny NetworkPolicy with narrow allows, hardened
containers, read-only model mounts.

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


def pod_templates() -> list[tuple[str, dict]]:
    """``(what, pod template)`` of every pod the bundle runs."""
    cluster = by_kind("RayCluster")["spec"]
    templates = [("ray-head", cluster["headGroupSpec"]["template"])]
    templates += [(f"ray-{group['groupName']}", group["template"]) for group in cluster["workerGroupSpecs"]]
    templates += [(doc["kind"], doc["spec"]["template"]) for _, doc in documents()
                  if doc["kind"] in ("Job", "Deployment")]
    return templates


def containers() -> list[tuple[str, dict, dict]]:
    """``(what, container, pod spec)`` of every container."""
    return [(f"{what}/{container['name']}", container, template["spec"]) for what, template in pod_templates()
            for container in template["spec"]["containers"]]


def command_of(kind: str) -> list[str]:
    (container,) = by_kind(kind)["spec"]["template"]["spec"]["containers"]
    return container["command"]


def test_every_kuberay_document_validates_against_its_crd(validators):
    checked = []
    for name, doc in documents():
        if doc["apiVersion"].startswith("ray.io/"):
            assert errors(validators, doc) == [], name
            checked.append(doc["kind"])
    assert sorted(checked) == ["RayCluster"]


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


def test_the_deployer_job_runs_disco_up_on_the_cluster_over_ray_client():
    cluster = by_kind("RayCluster")
    argv = command_of("Job")
    assert argv[:2] == ["disco", "up"]
    args = build_parser().parse_args(argv[1:])  # every flag exists
    head_ports = {p["name"]: p["containerPort"]
                  for p in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert args.address == f"ray://{cluster['metadata']['name']}-head-svc:{head_ports['client']}"
    assert args.no_orchestrator and args.placement == "spread" and not args.insecure
    groups = {group["groupName"]: group for group in cluster["spec"]["workerGroupSpecs"]}
    for role in ("target", "draft"):  # each role asks for the resource its worker group advertises
        (name,) = json.loads(json.loads(groups[role]["rayStartParams"]["resources"]))
        assert getattr(args, f"{role}_resource") == [f"{name}=1"]
    # The replicas bind their pod's IP: mTLS (a CA) is what lets `disco up` start them.
    assert args.tls_cert and args.tls_key and args.tls_ca and args.tls_server_name


def test_the_orchestrator_service_and_probes_point_at_its_ports():
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
    assert ports["grpc"] == args.port and ports["http"] == args.http_port and ports["metrics"] == args.metrics_port
    # TLS on the public port: Kubernetes' gRPC probes speak plaintext, so the probes ask the
    # HTTP API's /health over HTTPS (no token needed).
    assert args.tls_cert and args.tls_key and args.tls_ca and args.auth_token_file
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}, probe
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    service_ports = {port["name"]: port for port in service["spec"]["ports"]}
    assert set(service_ports) == {"grpc", "http"}
    assert service_ports["grpc"]["targetPort"] == "grpc" and service_ports["grpc"]["port"] == args.port
    assert service_ports["http"]["targetPort"] == "http"


SECRET_VARIABLES = {"RAY_AUTH_TOKEN", "DISCO_BACKEND_TOKEN", "DISCO_AUTH_TOKEN"}
SECRET_FILE_FLAGS = ("--auth-token-file", "--backend-token-file", "--tls-cert", "--tls-key", "--tls-ca")


def secret_mounts(container: dict, pod: dict) -> dict[str, str]:
    """``{mount path: Secret name}`` of the container's secret volumes (all read-only)."""
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        if mount["name"] in secrets:
            assert mount.get("readOnly") is True, mount
            mounts[mount["mountPath"]] = secrets[mount["name"]]
    return mounts


def test_every_credential_comes_from_a_secret_never_a_literal():
    """Tokens arrive as ``secretKeyRef`` environment variables or files on read-only secret
    volumes; no command line carries a token; no manifest holds one."""
    used: set[str] = set()
    for what, container, pod in containers():
        for variable in container.get("env", []):
            if variable["name"] in SECRET_VARIABLES:
                assert "value" not in variable, (what, variable["name"])
                used.add(variable["valueFrom"]["secretKeyRef"]["name"])
        command = container.get("command", []) + container.get("args", [])
        assert "--auth-token" not in command and "--backend-token" not in command, what  # flags show in `ps`
        mounts = secret_mounts(container, pod)
        used.update(mounts.values())
        for flag, value in zip(command, command[1:]):
            if flag in SECRET_FILE_FLAGS:
                assert any(value.startswith(path + "/") for path in mounts), (what, flag, value)
    assert used == {"disco-ray-auth", "disco-backend", "disco-auth", "disco-tls"}
    text = "".join(path.read_text() for path in MANIFESTS.glob("*.yaml"))
    assert "kind: Secret\n" not in text and "stringData" not in text  # created by the operator (docs/deploy.md)
    guide = (REPO / "docs" / "deploy.md").read_text()
    for secret in used:  # the guide says how to create each one
        assert re.search(rf"kubectl create secret \S+ {secret}\b", guide), secret


def test_ray_token_authentication_is_on_for_every_ray_process_and_client():
    cluster = by_kind("RayCluster")["spec"]
    assert cluster["authOptions"]["mode"] == "token"
    for what, container, _ in containers():
        env = {variable["name"]: variable for variable in container.get("env", [])}
        assert env["RAY_AUTH_MODE"]["value"] == "token", what  # the Ray pods, the orchestrator and the deployer
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": cluster["authOptions"]["secretName"], "key": "auth_token"}, what


def test_the_dashboard_listens_on_localhost_only():
    cluster = by_kind("RayCluster")["spec"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"].get("dashboard-host") == "127.0.0.1" or \
        head["rayStartParams"].get("include-dashboard") == "false"
    for params in [head["rayStartParams"], *(group["rayStartParams"] for group in cluster["workerGroupSpecs"])]:
        assert not any(value in ("0.0.0.0", "::") for value in params.values()), params
    for what, container, _ in containers():
        assert all(port["containerPort"] != 8265 for port in container.get("ports", [])), what


def test_containers_are_hardened_and_models_read_only():
    for what, template in pod_templates():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, what
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, what
        assert spec["automountServiceAccountToken"] is False, what
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "disco-serve", what  # NetworkPolicy
        claims = {v["name"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
        for volume in spec["volumes"]:
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["readOnly"] is True, what
        empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["capabilities"] == {"drop": ["ALL"]}
            assert context["readOnlyRootFilesystem"] is True and context["runAsNonRoot"] is True, what
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert mounts["/tmp"]["name"] in empty, what  # Ray's session files, caches: writable
            for mount in container["volumeMounts"]:
                if mount["name"] in claims:
                    assert mount["readOnly"] is True, (what, mount)


def policies() -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc["spec"] for _, doc in documents() if doc["kind"] == "NetworkPolicy"}


def selects(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
               if e["operator"] == "In")


def allowed_ports(labels: dict, source: dict | None) -> set:
    """Ports open to a pod with ``labels`` from ``source`` (pod labels; ``None``: anywhere
    outside the namespace's labelled pods), over the policies that select the pod; ``"*"``: all."""
    open_ports: set = set()
    for spec in policies().values():
        if "Ingress" not in spec["policyTypes"] or not selects(spec["podSelector"], labels):
            continue
        for rule in spec.get("ingress", []):
            peers = rule.get("from")
            if peers is not None and not any(
                    source is not None and "podSelector" in p and "namespaceSelector" not in p
                    and selects(p["podSelector"], source) for p in peers):
                continue
            open_ports |= ({f"{p['port']}-{p['endPort']}" if "endPort" in p else p["port"] for p in rule["ports"]}
                           if "ports" in rule else {"*"})
    return open_ports


def test_a_default_deny_network_policy_with_narrow_allows():
    specs = policies()
    deny = specs["disco-default-deny"]
    assert set(deny["policyTypes"]) == {"Ingress", "Egress"} and "ingress" not in deny and "egress" not in deny
    for what, template in pod_templates():  # every pod of the bundle is under the default deny
        assert selects(deny["podSelector"], template["metadata"]["labels"]), what
    cluster = by_kind("RayCluster")["metadata"]["name"]
    orchestrator = by_kind("Deployment")["spec"]["template"]["metadata"]["labels"]
    deployer = by_kind("Job")["spec"]["template"]["metadata"]["labels"]
    head = {"ray.io/cluster": cluster, "ray.io/node-type": "head", "app.kubernetes.io/name": "disco-serve"}
    worker = {**head, "ray.io/node-type": "worker"}
    # The public API from anywhere, and nothing else of the orchestrator.
    assert allowed_ports(orchestrator, None) == {50051, 8000}
    # Ray's pods: from each other on any port; the Ray Client port from the orchestrator and
    # the deployer only; the replicas' ports from the orchestrator; nothing from elsewhere.
    assert allowed_ports(head, worker) == {"*"} and allowed_ports(worker, head) == {"*"}
    assert allowed_ports(head, None) == set() and allowed_ports(worker, None) == set()
    assert allowed_ports(head, orchestrator) == {10001} == allowed_ports(head, deployer)
    assert allowed_ports(worker, orchestrator) == {"1024-65535"} and allowed_ports(worker, deployer) == set()
    # Metrics only from a monitoring namespace.
    monitoring = [p for spec in specs.values() for rule in spec.get("ingress", []) for p in rule.get("from", [])
                  if "namespaceSelector" in p]
    assert monitoring and all(p["namespaceSelector"] == {"matchLabels": {"disco.dev/monitoring": "true"}}
                              for p in monitoring)


def test_every_volume_claim_is_declared():
    claims = {doc["metadata"]["name"] for _, doc in documents() if doc["kind"] == "PersistentVolumeClaim"}
    used = set(re.findall(r"claimName: (\S+)", "".join(p.read_text() for p in MANIFESTS.glob("*.yaml"))))
    assert used and used <= claims
