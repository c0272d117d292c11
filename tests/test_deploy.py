"""deploy/: the Kubernetes manifests, the prometheus-adapter rule and the
Grafana dashboard.

- Each kustomization (base and overlays) is rendered here, with the part of
  kustomize these manifests use (resources, strategic-merge patches,
  replicas, images; anything else fails the test), and every resource is
  validated offline against the Kubernetes 1.30 JSON schemas
  (``kubernetes-validate``, strict: no unknown fields). Where ``kubectl`` is
  installed, its ``kubectl kustomize`` must render the same resources.
- The rendered resources fit together and fit the programs: Services select
  the pods and name their ports, the container command lines parse with the
  gateway's and the workers' own parsers, the workers advertise their pod IP
  and register with a headless Service of the gateway pods, probes, preStop
  and grace periods match the drain, every pool asks for a GPU, the cluster
  token comes from the Secret the template describes, and each autoscaler
  scales its pool on the gateways' recommendation for that role.
- Every metric the dashboard, the autoscalers and the adapter rule query is
  on the ``/metrics`` of a live gateway or of its live prefill and decode
  workers (``python -m gateway`` with its embedded tiny-model workers, on
  the CPU), with the labels the queries use.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from workers import REPO, launch_gateway

from decode_server import DECODE_ROLE
from gateway.__main__ import _gateway_config
from gateway.__main__ import build_parser as gateway_parser
from prefill_server import PREFILL_ROLE
from worker.cli import build_parser as worker_parser
from worker.cli import config_from_args
from worker.config import CLUSTER_TOKEN_ENV, REGISTER_KEY_ENV
from worker.front import STOP_GRACE_S
from worker.roles import COLOCATED

# In the test extra; a machine without it (the GPU one) skips the module.
kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
OVERLAYS = ("single-node", "multi-node")
KUSTOMIZATIONS = {"base": BASE, **{o: K8S / "overlays" / o for o in OVERLAYS}}
SECRET_TEMPLATE = BASE / "cluster-token.example.yaml"
ADAPTER_VALUES = DEPLOY / "prometheus-adapter" / "values.yaml"
DASHBOARD = DEPLOY / "grafana" / "dashboard.json"

K8S_VERSION = "1.30.0"
"""The Kubernetes version whose schemas the manifests must satisfy."""
GPU = "nvidia.com/gpu"
RECOMMENDATION = "gateway_recommended_replicas"
POOLS = {"prefill": ("prefill_server", PREFILL_ROLE), "decode": ("decode_server", DECODE_ROLE)}
"""Pool (Deployment name, worker role) -> its module and role."""


# -- kustomize: the part these manifests use ----------------------------------

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches", "replicas", "images"}
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "name",
    "imagePullSecrets": "name",
    "topologySpreadConstraints": "topologyKey",
}
"""Lists a strategic-merge patch merges item by item (by this key) in the
pod template; every other list is replaced whole."""
UNRENDERED_LISTS = {"ports", "hostAliases"}
"""Lists merged by a key that depends on where they are (a container's ports
by containerPort, a Service's by port): the patches here leave them alone,
and a patch that touches one fails the render."""

Key = tuple[str, str]
"""(kind, name) of a resource."""


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _key(doc: dict[str, Any]) -> Key:
    return doc["kind"], doc["metadata"]["name"]


def _merge(base: Any, patch: Any, field: str = "") -> Any:
    """``patch`` merged into ``base`` as a strategic-merge patch does for the
    fields above: maps key by key (null deletes), merged lists item by item
    (new items first, as kustomize puts them), other lists and scalars
    replaced."""
    if isinstance(patch, dict) and isinstance(base, dict):
        assert not any(k.startswith("$") for k in patch), f"directive in patch: {patch}"
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(patch, list) and isinstance(base, list):
        assert field not in UNRENDERED_LISTS, f"patching list {field!r} is not rendered"
        key = MERGE_KEYS.get(field)
        if key is None:
            return copy.deepcopy(patch)
        ours = {item[key]: item for item in patch}
        theirs = {item[key] for item in base}
        merged = [_merge(i, ours[i[key]], field) if i[key] in ours else i for i in base]
        return [copy.deepcopy(i) for i in patch if i[key] not in theirs] + merged
    return copy.deepcopy(patch)


def render(directory: Path) -> dict[Key, dict[str, Any]]:
    """The resources ``kubectl kustomize directory`` outputs, by (kind, name)."""
    kz = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kz) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: kustomization fields not rendered here: {unknown}"
    out: dict[Key, dict[str, Any]] = {}
    for entry in kz.get("resources", []):
        path = (directory / entry).resolve()
        assert path.exists(), f"{directory}/kustomization.yaml: resource {entry} does not exist"
        docs = render(path).values() if path.is_dir() else _load_all(path)
        for doc in docs:
            assert _key(doc) not in out, f"{directory}: {_key(doc)} twice"
            out[_key(doc)] = doc
    for patch in kz.get("patches", []):
        assert set(patch) == {"path"}, f"{directory}: patch form not rendered here: {patch}"
        path = directory / patch["path"]
        assert path.is_file(), f"{directory}/kustomization.yaml: patch {path} does not exist"
        for doc in _load_all(path):
            assert _key(doc) in out, f"{path}: patches {_key(doc)}, which is not rendered"
            assert doc["apiVersion"] == out[_key(doc)]["apiVersion"], path
            out[_key(doc)] = _merge(out[_key(doc)], doc)
    for r in kz.get("replicas", []):
        assert set(r) == {"name", "count"}, r
        targets = [k for k in out if k[1] == r["name"] and "replicas" in out[k].get("spec", {})]
        assert targets, f"{directory}: replicas for {r['name']}, which has none"
        for k in targets:
            out[k]["spec"]["replicas"] = r["count"]
    for image in kz.get("images", []):
        assert set(image) <= {"name", "newName", "newTag"}, image
        found = False
        for doc in out.values():
            for c in _containers(doc):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    found = True
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
        assert found, f"{directory}: image {image['name']} is used by no container"
    return out


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


@cache
def rendered(name: str) -> dict[Key, dict[str, Any]]:
    """One of ``KUSTOMIZATIONS``, rendered once (shared: a test that changes
    a resource changes a deep copy)."""
    return render(KUSTOMIZATIONS[name])


def _normalized(doc: Any) -> Any:
    """``doc`` through JSON: plain data on both sides of a comparison."""
    return json.loads(json.dumps(doc))


# -- the manifests: files, schemas -----------------------------------------------


def test_kustomizations_name_existing_files_and_every_yaml_file() -> None:
    """Every YAML file under deploy/k8s is a kustomization, a resource or a
    patch one of them names, or the Secret template; each exists."""
    named: set[Path] = {SECRET_TEMPLATE}
    for directory in KUSTOMIZATIONS.values():
        kz_path = directory / "kustomization.yaml"
        kz = yaml.safe_load(kz_path.read_text())
        assert (
            kz["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and kz["kind"] == "Kustomization"
        )
        named.add(kz_path)
        for entry in kz.get("resources", []):
            path = (directory / entry).resolve()
            assert path.exists(), f"{kz_path}: {entry} does not exist"
            named.add(path / "kustomization.yaml" if path.is_dir() else path)
        for patch in kz.get("patches", []):
            path = (directory / patch["path"]).resolve()
            assert path.is_file(), f"{kz_path}: {patch['path']} does not exist"
            named.add(path)
    files = {p.resolve() for p in K8S.rglob("*.y*ml")}
    assert files == named, f"not named by any kustomization: {sorted(files - named)}"


def _validate(doc: dict[str, Any], where: str) -> None:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = "/".join(map(str, e.path))
        pytest.fail(f"{where}: {_key(doc)} at {path}: {e.message}")


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_rendered_resources_match_the_kubernetes_schemas(name: str) -> None:
    resources = rendered(name)
    assert resources
    for doc in resources.values():
        _validate(doc, name)


def test_resource_files_and_the_secret_template_match_the_schemas() -> None:
    """The files as written (before any overlay), the Secret template included."""
    files = [SECRET_TEMPLATE, *BASE.glob("*.yaml"), *(K8S / "overlays").glob("*/*.yaml")]
    for path in files:
        if path.name == "kustomization.yaml" or _is_patch(path):
            continue
        for doc in _load_all(path):
            _validate(doc, str(path.relative_to(REPO)))


def _is_patch(path: Path) -> bool:
    kz = yaml.safe_load((path.parent / "kustomization.yaml").read_text())
    return path.name in {p["path"] for p in kz.get("patches", [])}


def test_the_schema_check_catches_a_misspelled_field() -> None:
    doc = copy.deepcopy(rendered("base")[("Deployment", "prefill")])
    _containers(doc)[0]["readinesProbe"] = _containers(doc)[0].pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_renderer_merges_as_kustomize_does() -> None:
    base = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}]}]}}
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}]}]}}
    merged = _merge(base, patch)
    assert merged["spec"]["containers"][0]["env"] == [
        {"name": "Y", "value": "2"},
        {"name": "X", "value": "1"},
    ]
    assert _merge({"args": ["a", "b"]}, {"args": ["c"]}) == {"args": ["c"]}
    assert _merge({"a": 1, "b": 2}, {"b": None}) == {"a": 1}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_kubectl_kustomize_renders_the_same(name: str) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZATIONS[name])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    theirs = {_key(d): _normalized(d) for d in yaml.safe_load_all(out.stdout) if d}
    ours = {k: _normalized(v) for k, v in rendered(name).items()}
    assert theirs.keys() == ours.keys()
    for k in ours:
        assert theirs[k] == ours[k], k


# -- the manifests: how the parts fit ------------------------------------------


def _one(resources: dict[Key, dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    assert (kind, name) in resources, f"no {kind} {name}"
    return resources[(kind, name)]


def _pod_labels(doc: dict[str, Any]) -> dict[str, str]:
    return doc["spec"]["template"]["metadata"]["labels"]


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    (c,) = _containers(doc)
    return c


def _port(container: dict[str, Any], port: int | str) -> int:
    """A container port by number or name."""
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    if isinstance(port, str):
        assert port in ports, f"{container['name']}: no port named {port}"
        return ports[port]
    assert port in ports.values(), f"{container['name']}: port {port} not declared"
    return port


def _secret_template() -> dict[str, Any]:
    (doc,) = _load_all(SECRET_TEMPLATE)
    return doc


def _env(resources: dict[Key, dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet sets it: values, ConfigMap
    keys of the rendered ConfigMaps, the pod IP (an example address) and the
    cluster token Secret (a stand-in value); other Secrets must be optional."""
    secret = _secret_template()
    out: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            out[e["name"]] = e["value"]
            continue
        src = e["valueFrom"]
        if "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            data = _one(resources, "ConfigMap", ref["name"])["data"]
            assert ref["key"] in data, f"ConfigMap {ref['name']} has no key {ref['key']}"
            out[e["name"]] = data[ref["key"]]
        elif "fieldRef" in src:
            assert src["fieldRef"]["fieldPath"] == "status.podIP", e
            out[e["name"]] = "10.1.2.3"
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            if ref["name"] == secret["metadata"]["name"]:
                assert ref["key"] in secret["stringData"], e
                out[e["name"]] = "token-from-the-secret"
            else:
                assert ref.get("optional") is True, f"{e['name']}: Secret {ref['name']} required"
        else:
            pytest.fail(f"env {e['name']}: unexpected source {src}")
    return out


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """``$(VAR)`` in the container's args, as the kubelet expands them."""

    def one(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not in the container's env"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, a) for a in args]


def _in_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in (CLUSTER_TOKEN_ENV, REGISTER_KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def _prestop_s(container: dict[str, Any]) -> float:
    cmd = container["lifecycle"]["preStop"]["exec"]["command"]
    assert cmd[0] == "sleep" and len(cmd) == 2, cmd
    return float(cmd[1])


def _http_get(probe: dict[str, Any], container: dict[str, Any]) -> tuple[str, int]:
    return probe["httpGet"]["path"], _port(container, probe["httpGet"]["port"])


def _cluster_token_from_secret(container: dict[str, Any]) -> None:
    secret = _secret_template()
    (entry,) = [e for e in container["env"] if e["name"] == CLUSTER_TOKEN_ENV]
    ref = entry["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert ref.get("optional") is not True


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_services_select_the_gateway_pods(name: str) -> None:
    resources = rendered(name)
    gateway = _one(resources, "Deployment", "gateway")
    labels = _pod_labels(gateway)
    for svc_name in ("gateway", "gateway-peers"):
        svc = _one(resources, "Service", svc_name)
        assert svc["spec"]["selector"].items() <= labels.items(), svc_name
        for p in svc["spec"]["ports"]:
            _port(_container(gateway), p["targetPort"])
        # No other Deployment's pods are selected.
        for (kind, other), doc in resources.items():
            if kind == "Deployment" and other != "gateway":
                assert not svc["spec"]["selector"].items() <= _pod_labels(doc).items()
    peers = _one(resources, "Service", "gateway-peers")["spec"]
    # Headless: the name resolves to every gateway pod, ready or not (a
    # gateway is ready only once workers have registered with it).
    assert peers["clusterIP"] == "None" and peers["publishNotReadyAddresses"] is True
    assert _one(resources, "Service", "gateway")["spec"].get("clusterIP") != "None"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_the_gateway_deployment(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    resources = rendered(name)
    doc = _one(resources, "Deployment", "gateway")
    c = _container(doc)
    assert c["command"] == ["python", "-m", "gateway"]
    env = _env(resources, c)
    _cluster_token_from_secret(c)
    _in_env(monkeypatch, env)
    cfg = _gateway_config(gateway_parser().parse_args(_expand(c["args"], env)))
    # No embedded workers: the pools register.
    assert cfg.wait_for_workers and not cfg.prefill and not cfg.decode
    assert cfg.host == "0.0.0.0" and cfg.admin_bearer == "token-from-the-secret"
    # The planner's objectives, which the autoscalers' recommendation is sized
    # to, come from the ConfigMap.
    data = _one(resources, "ConfigMap", "disagg-serve")["data"]
    assert cfg.planner.slo_ttft_s == float(data["slo-ttft-s"])
    assert cfg.planner.slo_tpot_s == float(data["slo-tpot-s"])
    assert _port(c, "http") == cfg.port
    assert _http_get(c["readinessProbe"], c) == ("/health", cfg.port)
    assert c["livenessProbe"]["httpGet"]["path"] in ("/health", "/metrics")
    grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > _prestop_s(c) + cfg.shutdown_timeout_s
    assert GPU not in c["resources"].get("limits", {})


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
@pytest.mark.parametrize("pool", list(POOLS))
def test_the_pool_deployments(name: str, pool: str, monkeypatch: pytest.MonkeyPatch) -> None:
    resources = rendered(name)
    doc = _one(resources, "Deployment", pool)
    c = _container(doc)
    module, role = POOLS[pool]
    assert c["command"] == ["python", "-m", module]
    assert doc["spec"]["replicas"] >= 1
    env = _env(resources, c)
    _cluster_token_from_secret(c)
    _in_env(monkeypatch, env)
    parser = worker_parser(f"python -m {module}", (role, COLOCATED), 30000)
    cfg = config_from_args(parser.parse_args(_expand(c["args"], env)))
    assert cfg.role == role.name
    # Reachable from other pods at the pod's own IP, on declared ports.
    assert cfg.host == "0.0.0.0" and cfg.advertise_host == env["POD_IP"]
    assert cfg.url == f"http://{env['POD_IP']}:{cfg.port}"
    for port in (cfg.port, cfg.request_port, cfg.bootstrap_port):
        assert port > 0, "a fixed port, declared on the container"
        _port(c, port)
    assert cfg.cluster_token == "token-from-the-secret" and not cfg.register_key
    # Registers with every gateway pod: the headless Service's name and port.
    assert cfg.register is not None
    url = urlsplit(cfg.register)
    peers = _one(resources, "Service", url.hostname or "")
    assert peers["spec"]["clusterIP"] == "None"
    assert (
        peers["spec"]["selector"].items()
        <= _pod_labels(_one(resources, "Deployment", "gateway")).items()
    )
    assert url.port in [p["port"] for p in peers["spec"]["ports"]]
    # Health, drain and the grace period that lets the drain finish.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _http_get(c[probe], c) == ("/health", cfg.port), probe
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > cfg.shutdown_timeout_s
    grace = doc["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > _prestop_s(c) + cfg.shutdown_timeout_s + STOP_GRACE_S
    # One GPU per pod (extended resources: the limit is the request).
    assert c["resources"]["limits"][GPU] == 1
    assert GPU not in c["resources"].get("requests", {})


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_the_pools_agree_on_the_transfer_backend_and_model(name: str) -> None:
    resources = rendered(name)
    picked = []
    for pool in POOLS:
        c = _container(_one(resources, "Deployment", pool))
        env = _env(resources, c)
        args = _expand(c["args"], env)
        picked.append((args[args.index("--transfer-backend") + 1], args[args.index("--model") + 1]))
    assert picked[0] == picked[1]


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
@pytest.mark.parametrize("pool", list(POOLS))
def test_each_pool_scales_on_the_gateways_recommendation(name: str, pool: str) -> None:
    hpa = _one(rendered(name), "HorizontalPodAutoscaler", pool)
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", pool)
    deployment = _one(rendered(name), "Deployment", pool)
    spec = hpa["spec"]
    assert 1 <= spec["minReplicas"] <= deployment["spec"]["replicas"] <= spec["maxReplicas"]
    (metric,) = spec["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["name"] == RECOMMENDATION
    assert metric["external"]["metric"]["selector"] == {"matchLabels": {"role": pool}}
    # replicas = ceil(recommendation / 1): the recommended count itself.
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}


def test_multi_node_spreads_and_single_node_fits_one_node() -> None:
    multi, single = rendered("multi-node"), rendered("single-node")
    gw = _one(multi, "Deployment", "gateway")
    assert gw["spec"]["replicas"] >= 2
    assert gw["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    for pool in POOLS:
        spread = _one(multi, "Deployment", pool)["spec"]["template"]["spec"]
        keys = [t["topologyKey"] for t in spread["topologySpreadConstraints"]]
        assert "kubernetes.io/hostname" in keys
        # The base's env is kept under the patch's.
        names = [e["name"] for e in _container(_one(multi, "Deployment", pool))["env"]]
        assert {CLUSTER_TOKEN_ENV, "POD_IP", "NCCL_SOCKET_IFNAME"} <= set(names)
    # One node of 8 GPUs: the pools' maxima together fit on it, and a
    # rollout needs no spare GPU.
    most = sum(_one(single, "HorizontalPodAutoscaler", p)["spec"]["maxReplicas"] for p in POOLS)
    assert most <= 8
    for pool in POOLS:
        assert _one(single, "Deployment", pool)["spec"]["strategy"]["rollingUpdate"] == {
            "maxSurge": 0,
            "maxUnavailable": 1,
        }


# -- PromQL: which metrics and labels a query reads ---------------------------

TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod"})
"""Labels Prometheus adds to every series it scrapes from a pod (the usual
kubernetes-pods scrape job), which no /metrics shows."""
AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values"}
    | {"bottomk", "topk", "quantile", "limitk", "limit_ratio"}
)
GROUPING = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "inf", "nan"})
_TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>\d+(?:ms|[smhdwy])\b)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<variable>\$\{?\w+\}?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>\S)
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class Query:
    selectors: tuple[tuple[str, frozenset[str]], ...]
    """(metric name, label names its matchers use) of each vector selector."""
    grouping: frozenset[str]
    """Label names of by/without/on/ignoring/group_left/group_right clauses."""


def parse_promql(expr: str) -> Query:
    """The metric names and label names a PromQL expression uses. Grafana's
    variables count as values; template placeholders must be filled first."""
    tokens = [
        (m.lastgroup, m.group())
        for m in _TOKEN.finditer(expr)
        if m.lastgroup not in ("string", "range", "duration", "number", "variable")
    ]
    selectors: list[tuple[str, frozenset[str]]] = []
    grouping: set[str] = set()
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "ident" and text in GROUPING:
            i += 1
            if following == "(":
                end = next(j for j in range(i, len(tokens)) if tokens[j][1] == ")")
                grouping |= {t for k, t in tokens[i + 1 : end] if k == "ident"}
                i = end
        elif kind == "ident" and (text in AGGREGATIONS or text in KEYWORDS or following == "("):
            pass  # an aggregation, a function or an operator
        elif kind == "ident" or text == "{":
            name = text if kind == "ident" else ""
            labels: set[str] = set()
            if text == "{" or following == "{":
                start = i + (1 if text == "{" else 2)
                end = next(j for j in range(start, len(tokens)) if tokens[j][1] == "}")
                labels = {t for k, t in tokens[start:end] if k == "ident"}
                i = end
            assert name, f"a selector without a metric name: {expr!r}"
            selectors.append((name, frozenset(labels)))
        i += 1
    return Query(tuple(selectors), frozenset(grouping))


def parse_exposition(text: str) -> dict[str, set[str]]:
    """Sample name -> label names seen on it, of a Prometheus text exposition."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s", line)
        assert m, f"not a sample line: {line!r}"
        labels = re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="(?:[^"\\]|\\.)*"', m.group(2) or "")
        out.setdefault(m.group(1), set()).update(labels)
    return out


def problems(queries: list[str], exposed: dict[str, set[str]]) -> list[str]:
    """What ``queries`` read that ``exposed`` (sample name -> label names) lacks:
    metric names, labels of their matchers, and grouping labels that no
    metric of the query has."""
    out = []
    for q in queries:
        parsed = parse_promql(q)
        assert parsed.selectors, f"no metric in {q!r}"
        known = set(TARGET_LABELS)
        for name, labels in parsed.selectors:
            if name not in exposed:
                out.append(f"{name} is on no live /metrics (in {q!r})")
                continue
            known |= exposed[name]
            if extra := labels - exposed[name] - TARGET_LABELS:
                out.append(f"{name} has no label {sorted(extra)} (in {q!r})")
        if extra := parsed.grouping - known:
            out.append(f"no metric has the labels {sorted(extra)} (in {q!r})")
    return out


@pytest.mark.parametrize(
    ("expr", "selectors", "grouping"),
    [
        ("up", [("up", set())], set()),
        (
            'histogram_quantile(0.9, sum by (le, stage) (rate(a_bucket{ns=~"$x"}[$__rate_interval])))',
            [("a_bucket", {"ns"})],
            {"le", "stage"},
        ),
        (
            'sum by (role) (b * on (job, instance) group_left (role) c{role=~"p|d"}) / 2e3',
            [("b", set()), ("c", {"role"})],
            {"role", "job", "instance"},
        ),
        (
            "max(d offset 5m) and count without (x) (e{y!=\"1\",z='2'})",
            [("d", set()), ("e", {"y", "z"})],
            {"x"},
        ),
    ],
)
def test_promql_parsing(expr: str, selectors: list[Any], grouping: set[str]) -> None:
    q = parse_promql(expr)
    assert [(n, set(ls)) for n, ls in q.selectors] == selectors
    assert q.grouping == grouping


def test_the_check_reports_unknown_metrics_and_labels() -> None:
    exposed = parse_exposition('m_total{kind="x"} 1\nh_bucket{le="1"} 0\n# TYPE n gauge\n')
    assert exposed == {"m_total": {"kind"}, "h_bucket": {"le"}}
    assert not problems(['sum by (kind) (rate(m_total{namespace="a"}[5m]))'], exposed)
    found = problems(
        [
            "n",  # declared by a TYPE line, but no sample
            'rate(m_total{endpoint="chat"}[1m])',
            "sum by (le, role) (h_bucket)",
        ],
        exposed,
    )
    assert len(found) == 3 and "n is on no live" in found[0]
    assert "['endpoint']" in found[1] and "['role']" in found[2]


# -- the dashboard, the adapter rule and the autoscalers' metric ----------------


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets (rows'
    nested panels too) and query variables (``label_values(metric, label)``
    as the selector ``metric{label}``)."""
    dash = json.loads(DASHBOARD.read_text())
    out = []
    panels = list(dash["panels"])
    while panels:
        p = panels.pop()
        panels += p.get("panels", [])
        out += [t["expr"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\(\s*(.+?)\s*,\s*(\w+)\s*\)", q)
        assert m, f"variable {var['name']}: {q!r}"
        out.append(f'{m.group(1)}{{{m.group(2)}!=""}}')
    return out


def adapter_rules() -> list[dict[str, Any]]:
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    return values["rules"]["external"]


def adapter_queries() -> list[str]:
    """The adapter rules' series queries, and their metrics queries with the
    series and the (HPA's) label matchers filled in."""
    out = []
    for rule in adapter_rules():
        series = rule["seriesQuery"]
        (name, _), *_ = parse_promql(series).selectors
        metrics = rule["metricsQuery"].replace("<<.Series>>", name)
        out += [series, metrics.replace("{<<.LabelMatchers>>}", '{namespace="x"}')]
        assert "<<" not in out[-1], rule["metricsQuery"]
    return out


def autoscaler_queries() -> list[str]:
    """The autoscalers' External metrics as selectors (name and matchLabels),
    after checking that an adapter rule serves each under that name."""
    served = {r["name"]["as"] for r in adapter_rules()}
    out = []
    for resources in map(rendered, KUSTOMIZATIONS):
        for (kind, _), doc in resources.items():
            if kind != "HorizontalPodAutoscaler":
                continue
            for m in doc["spec"]["metrics"]:
                metric = m["external"]["metric"]
                assert metric["name"] in served, f"no adapter rule serves {metric['name']}"
                labels = ",".join(
                    f'{k}="{v}"' for k, v in metric["selector"]["matchLabels"].items()
                )
                out.append(f"{metric['name']}{{{labels}}}")
    return out


def test_the_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace"} <= variables
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), (p["title"], var)
    queries = "\n".join(dashboard_queries())
    # What the dashboard is for: latency quantiles from the gateways'
    # histograms, traffic, worker state, and the scaling recommendation.
    for metric in (
        "gateway_time_to_first_token_seconds_bucket",
        "gateway_inter_token_latency_seconds_bucket",
        "gateway_e2e_request_latency_seconds_bucket",
    ):
        assert f"histogram_quantile(0.99, sum by (le) (rate({metric}" in queries
    for metric in (
        "gateway_requests_total",
        "gateway_request_failures_total",
        "gateway_worker_healthy",
        "worker_running_requests",
        "worker_waiting_requests",
        "worker_total_pages",
        RECOMMENDATION,
    ):
        assert metric in queries


LIVE_START_TIMEOUT_S = 120.0
"""The gateway and its two embedded workers loading the tiny model on a small
CPU machine."""
TOKEN = "deploy-test-token"


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The /metrics of a gateway and of its prefill and decode workers
    (``python -m gateway`` with its embedded tiny-model workers), after a
    streamed chat completion and a failed request, so that every family has
    samples."""
    log = tmp_path_factory.mktemp("deploy") / "gateway.log"
    env = {"OMP_NUM_THREADS": "1", CLUSTER_TOKEN_ENV: TOKEN}
    with (
        launch_gateway([], log, LIVE_START_TIMEOUT_S, env) as (url, _proc),
        httpx.Client(timeout=60) as client,
    ):
        model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
            "stream": True,
        }
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            assert "[DONE]" in "".join(resp.iter_text())
        bad = client.post(f"{url}/v1/completions", json={"model": "none", "prompt": "x"})
        assert bad.status_code == 404
        out = {"gateway": client.get(f"{url}/metrics").text}
        auth = {"Authorization": f"Bearer {TOKEN}"}
        workers = client.get(f"{url}/admin/workers", headers=auth).json()["workers"]
        for w in workers:
            out[w["role"]] = client.get(f"{w['url']}/metrics").text
    assert set(out) == {"gateway", "prefill", "decode"}
    return out


def _exposed(live: dict[str, str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for text in live.values():
        for name, labels in parse_exposition(text).items():
            out.setdefault(name, set()).update(labels)
    return out


@pytest.mark.e2e
def test_every_dashboard_metric_is_on_a_live_gateway_or_worker(
    live_metrics: dict[str, str],
) -> None:
    found = problems(dashboard_queries(), _exposed(live_metrics))
    assert not found, "\n".join(found)


@pytest.mark.e2e
def test_the_autoscalers_metric_is_on_a_live_gateway(live_metrics: dict[str, str]) -> None:
    gateway = parse_exposition(live_metrics["gateway"])
    found = problems(adapter_queries() + autoscaler_queries(), gateway)
    assert not found, "\n".join(found)
