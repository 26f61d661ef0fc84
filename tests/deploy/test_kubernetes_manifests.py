"""deploy/kubernetes/: every manifest validated offline, and checked against the roofline CLI it runs.

Kubernetes-native objects are validated with kubernetes-validate (the Kubernetes JSON schemas it bundles,
strict: unknown fields fail) at KUBE_VERSION; LeaderWorkerSets against the LWS CRD's schema vendored in
schemas/ (made strict the same way).  Where `kubectl` is installed, each kustomization is also rendered with
`kubectl kustomize` and its output validated, so patches are checked in their merged form.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUBE_VERSION = "1.30"  # the oldest Kubernetes the manifests target (preStop `sleep` is on by default from 1.30)
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_NAME"}  # set by LWS in every pod
SAMPLE_ENV = {"LWS_LEADER_ADDRESS": "roofline-0.roofline.default", "LWS_WORKER_INDEX": "1",
              "LWS_NAME": "roofline", "POD_IP": "10.0.0.7"}  # LWS_GROUP_SIZE: the LWS's own size


def _load(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


YAML_FILES = sorted(DEPLOY.rglob("*.yaml"))
KUSTOMIZATIONS = [p for p in YAML_FILES if p.name == "kustomization.yaml"]


def _patch_files() -> set[Path]:
    out = set()
    for k in KUSTOMIZATIONS:
        for entry in _load(k)[0].get("patches", []) + _load(k)[0].get("patchesStrategicMerge", []):
            path = entry.get("path") if isinstance(entry, dict) else entry
            if path:
                out.add((k.parent / path).resolve())
    return out


PATCH_FILES = _patch_files()
RESOURCE_DOCS = [(p, i, d) for p in YAML_FILES if p.name != "kustomization.yaml" and p.resolve() not in PATCH_FILES
                 for i, d in enumerate(_load(p))]


def _id(p: Path, i: int = 0, d: dict | None = None) -> str:
    rel = str(p.relative_to(DEPLOY))
    return f"{rel}#{i}:{d.get('kind')}/{d.get('metadata', {}).get('name')}" if d else rel


def _strict(schema):
    """A CRD schema as `kubectl apply --validate=strict` reads it: unknown fields are errors."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


_LWS_VALIDATOR = None


def lws_validator() -> jsonschema.Validator:
    global _LWS_VALIDATOR
    if _LWS_VALIDATOR is None:
        schema = _strict(json.loads((SCHEMAS / "leaderworkerset-v1.json").read_text()))
        jsonschema.Draft7Validator.check_schema(schema)
        _LWS_VALIDATOR = jsonschema.Draft7Validator(schema)
    return _LWS_VALIDATOR


def validate(doc: dict) -> None:
    if doc.get("kind") == "LeaderWorkerSet":
        assert doc.get("apiVersion") == LWS_API
        errors = sorted(lws_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
        assert not errors, "; ".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5])
    else:
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{'.'.join(map(str, e.absolute_path))}: {e.message}") from None


# ------------------------------------------------------------------ schemas


@pytest.mark.parametrize("path", YAML_FILES, ids=_id)
def test_every_yaml_document_parses(path):
    docs = _load(path)
    assert docs, f"{path} has no YAML document"
    for d in docs:
        assert isinstance(d, (dict, list))


@pytest.mark.parametrize("path,index,doc", RESOURCE_DOCS, ids=[_id(*r) for r in RESOURCE_DOCS])
def test_every_resource_validates(path, index, doc):
    validate(doc)


BAD_EDITS = [  # (kind, path to the field, bad value): an unknown field, a wrong type, unknown LWS fields
    ("Deployment", ("spec", "template", "spec", "containers", 0, "readinessProbes"), {}),
    ("Deployment", ("spec", "replicas"), "two"),
    ("LeaderWorkerSet", ("spec", "leaderWorkerTemplate", "sizes"), 2),
    ("LeaderWorkerSet", ("spec", "startupPolicy"), "LeaderHappy"),
]


@pytest.mark.parametrize("kind,path,value", BAD_EDITS, ids=[f"{k}-{p[-1]}" for k, p, _ in BAD_EDITS])
def test_validation_rejects_bad_manifests(kind, path, value):
    """The validators do fail."""
    doc = next(copy.deepcopy(d) for _, _, d in RESOURCE_DOCS if d["kind"] == kind)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    with pytest.raises(AssertionError):
        validate(doc)


# ------------------------------------------------------------------ kustomize


def _resources_of(kdir: Path) -> list[dict]:
    """Every resource a kustomization builds from (recursively through bases), before patches."""
    k = _load(kdir / "kustomization.yaml")[0]
    out = []
    for r in k.get("resources", []):
        p = (kdir / r).resolve()
        out += _resources_of(p) if p.is_dir() else _load(p)
    return out


@pytest.mark.parametrize("kfile", KUSTOMIZATIONS, ids=_id)
def test_kustomization_lists_existing_files(kfile):
    k = _load(kfile)[0]
    assert k["apiVersion"].startswith("kustomize.config.k8s.io/") and k["kind"] == "Kustomization"
    assert k.get("resources"), "a kustomization with no resources"
    for r in k.get("resources", []):
        p = kfile.parent / r
        assert p.is_file() or (p / "kustomization.yaml").is_file(), f"resource {r} does not exist"
    for entry in k.get("patches", []):
        assert "path" in entry, "inline patches: keep them in files the suite checks"
        assert (kfile.parent / entry["path"]).is_file(), f"patch {entry['path']} does not exist"


@pytest.mark.parametrize("kfile", KUSTOMIZATIONS, ids=_id)
def test_patches_target_existing_resources(kfile):
    k = _load(kfile)[0]
    have = {(d["kind"], d["metadata"]["name"]) for d in _resources_of(kfile.parent)}
    for entry in k.get("patches", []):
        docs = _load(kfile.parent / entry["path"])
        target = entry.get("target")
        if target:
            assert (target["kind"], target["name"]) in have, f"{entry['path']}: no {target} in {sorted(have)}"
        if docs and isinstance(docs[0], list):  # JSON 6902: needs a target
            assert target, f"{entry['path']} is a JSON patch without a target"
            continue
        for d in docs:
            assert (d["kind"], d["metadata"]["name"]) in have, f"{entry['path']} patches a missing resource"
            if d["kind"] == "Deployment":  # strategic merge by container name: the names must exist
                base = next(r for r in _resources_of(kfile.parent) if (r["kind"], r["metadata"]["name"]) ==
                            (d["kind"], d["metadata"]["name"]))
                names = {c["name"] for c in base["spec"]["template"]["spec"]["containers"]}
                for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                    assert c["name"] in names


def _render(kdir: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: kustomize rendering not checked")
    out = subprocess.run([kubectl, "kustomize", str(kdir)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.mark.parametrize("kfile", KUSTOMIZATIONS, ids=_id)
def test_rendered_kustomization_validates_and_is_consistent(kfile):
    docs = _render(kfile.parent)
    for d in docs:
        validate(d)
    _check_objects(docs)
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Service", "roofline") in kinds or ("Service", "roofline-router") in kinds
    if "multinode-lws" in str(kfile):
        assert ("Deployment", "roofline") not in kinds and ("LeaderWorkerSet", "roofline") in kinds
        hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": LWS_API, "kind": "LeaderWorkerSet", "name": "roofline"}


# ------------------------------------------------------------------ the roofline CLI in the containers


def _walk(obj, key):
    """Every value of `key` anywhere in obj (dicts and lists)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key:
                yield obj, v
            yield from _walk(v, key)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v, key)


def _pod_specs(doc):
    """(pod spec, pod template metadata, the LWS it belongs to or None) of every pod template in doc."""
    lws = doc if isinstance(doc, dict) and doc.get("kind") == "LeaderWorkerSet" else None
    for parent, tmpl in _walk(doc, "template"):
        if isinstance(tmpl, dict) and "spec" in tmpl:
            yield tmpl["spec"], tmpl.get("metadata", {}), lws
    if lws:
        for key in ("leaderTemplate", "workerTemplate"):
            t = lws["spec"]["leaderWorkerTemplate"].get(key)
            if t:
                yield t["spec"], t.get("metadata", {}), lws


def _roofline_parser() -> argparse.ArgumentParser:
    from roofline.entrypoints.cli import build_parser

    return build_parser()


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = _roofline_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _expand(arg: str, env_names: set[str], lws) -> str:
    def sub(m):
        name = m.group(1)
        assert name in env_names or (lws is not None and name in LWS_ENV), f"$({name}) is not in the container's env"
        if name == "LWS_GROUP_SIZE":
            return str(lws["spec"]["leaderWorkerTemplate"]["size"])
        return SAMPLE_ENV.get(name, "x")
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, arg)


def _roofline_containers(docs):
    """(container, pod spec, pod metadata, lws, subcommand, parsed namespace) of each roofline container."""
    for doc in docs:
        for spec, meta, lws in _pod_specs(doc):
            for c in spec.get("containers", []):
                if not c.get("args") or (c.get("command") and c["command"] != ["roofline"]):
                    continue  # a patch that leaves args alone, or not roofline
                assert c.get("command") in (None, ["roofline"])
                sub = c["args"][0]
                env_names = {e["name"] for e in c.get("env", [])}
                args = [_expand(a, env_names, lws) for a in c["args"]]
                known = _subparser(sub)._option_string_actions
                for a in args[1:]:
                    if a.startswith("-"):
                        flag = a.split("=", 1)[0]
                        assert flag in known, f"`roofline {sub}` has no flag {flag} (it would be an abbreviation)"
                try:
                    ns = _roofline_parser().parse_args(args)
                except SystemExit:
                    pytest.fail(f"`roofline {' '.join(args)}` does not parse")
                yield c, spec, meta, lws, sub, ns


def _all_docs():
    return [d for _, _, d in RESOURCE_DOCS] + [d for p in sorted(PATCH_FILES) for d in _load(p) if isinstance(d, dict)]


def test_every_roofline_command_parses():
    seen = {sub for *_, sub, _ in _roofline_containers(_all_docs())}
    assert seen == {"serve", "worker", "router"}


def test_json_flags_parse_with_the_codes_parsers():
    from roofline.config import KVTransferConfig
    from roofline.entrypoints.engine_flags import engine_args_from

    roles = set()
    for c, *_, sub, ns in _roofline_containers(_all_docs()):
        if sub in ("serve", "worker"):
            engine_args_from(ns)
            for dest, value in vars(ns).items():
                if isinstance(value, str) and value.lstrip().startswith("{"):
                    json.loads(value)
            if ns.kv_transfer_config:
                cfg = KVTransferConfig.from_json(ns.kv_transfer_config)
                roles.add(cfg.kv_role)
                if cfg.kv_role == "kv_producer":  # where decoders fetch the blocks: this pod, on a declared port
                    assert cfg.kv_ip == SAMPLE_ENV["POD_IP"]
                    assert cfg.kv_port in {p["containerPort"] for p in c.get("ports", [])}
    assert roles == {"kv_producer", "kv_consumer"}


def test_multinode_leader_and_workers_agree():
    rows = [(sub, ns, lws) for *_, lws, sub, ns in _roofline_containers(_all_docs()) if lws is not None]
    assert {sub for sub, _, _ in rows} == {"serve", "worker"}
    for sub, ns, lws in rows:
        size = lws["spec"]["leaderWorkerTemplate"]["size"]
        assert ns.nnodes == size >= 2
        world = ns.tensor_parallel_size * ns.pipeline_parallel_size * ns.data_parallel_size
        assert world % ns.nnodes == 0
        assert (ns.node_rank == 0) == (sub == "serve") and 0 <= ns.node_rank < size
        assert ns.master_addr == SAMPLE_ENV["LWS_LEADER_ADDRESS"]
    keys = {(ns.tensor_parallel_size, ns.pipeline_parallel_size, ns.nnodes, ns.master_port, ns.device, ns.model_pos
             if sub == "worker" else ns.model_tag) for sub, ns, _ in rows}
    assert len(keys) == 1, keys
    # the leader runs the engine; it and every worker present the shared secret
    for c, *_, lws, sub, ns in _roofline_containers(_all_docs()):
        if lws is not None:
            assert "ROOFLINE_DIST_SECRET" in {e["name"] for e in c.get("env", [])}


def _check_objects(docs):
    """Cross-object checks on a set of documents (the resource files, or one rendered kustomization)."""
    secrets = {d["metadata"]["name"]: set(d.get("data", {})) | set(d.get("stringData", {}))
               for d in docs if d.get("kind") == "Secret"}
    services = {d["metadata"]["name"]: {p["port"] for p in d["spec"]["ports"]} for d in docs if d.get("kind") == "Service"}
    for parent, ref in _walk(docs, "secretKeyRef"):
        assert ref["key"] in secrets.get(ref["name"], set()), f"secret {ref['name']} has no key {ref['key']}"
    for c, spec, meta, lws, sub, ns in _roofline_containers(docs):
        if sub == "worker":
            continue
        defaults = _subparser(sub)
        probe = c.get("readinessProbe", {}).get("httpGet", {})
        assert probe.get("path") == "/health", f"roofline {sub} needs a readiness probe on /health"
        ports = {p.get("name"): p["containerPort"] for p in c.get("ports", [])}
        assert ports.get(probe.get("port"), probe.get("port")) == ns.port
        assert ns.host == "0.0.0.0"
        ann = meta.get("annotations", {})
        assert ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/path") == "/metrics"
        assert int(ann["prometheus.io/port"]) == ns.port
        grace = spec.get("terminationGracePeriodSeconds", 30)
        if sub == "serve":
            shutdown = ns.shutdown_timeout if ns.shutdown_timeout is not None else defaults.get_default("shutdown_timeout")
            sleep = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
            assert grace > shutdown + sleep, f"terminationGracePeriodSeconds {grace} <= {shutdown} + preStop {sleep}"
        else:  # the router's uvicorn gives in-flight requests 10 s
            assert grace > 10
            for url in ns.prefill + ns.decode + ns.replica:
                u = urlparse(url)
                if services:
                    assert u.port in services.get(u.hostname, set()), f"router URL {url}: no such Service port"


def test_probes_grace_periods_secrets_and_scrape_annotations():
    _check_objects([d for _, _, d in RESOURCE_DOCS])
    # patches (checked merged only where kubectl renders them): no serve command line in a patch may drain
    # longer than the base pod's grace period allows
    base = next(d for _, _, d in RESOURCE_DOCS if d["kind"] == "Deployment" and d["metadata"]["name"] == "roofline")
    pod = base["spec"]["template"]["spec"]
    room = pod["terminationGracePeriodSeconds"] - pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    for c, *_, sub, ns in _roofline_containers(_all_docs()):
        if sub == "serve":
            assert ns.shutdown_timeout < room


def test_hpa_metric_is_served_by_the_adapter_rule_and_exported_by_roofline():
    from roofline.metrics.prometheus import PREFIX

    hpas = [d for _, _, d in RESOURCE_DOCS if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpas
    rules = yaml.safe_load(next(d for _, _, d in RESOURCE_DOCS if d["kind"] == "ConfigMap"
                                and "prometheus-adapter" in d["metadata"]["name"])["data"]["config.yaml"])["rules"]
    served = {r["name"]["as"]: r for r in rules}
    for hpa in hpas:
        for m in hpa["spec"]["metrics"]:
            assert m["type"] == "Pods"
            rule = served[m["pods"]["metric"]["name"]]
            assert rule["seriesQuery"].startswith(PREFIX + "num_requests_waiting{")
            assert re.fullmatch(rule["name"]["matches"], PREFIX + "num_requests_waiting")
    src = (ROOT / "roofline" / "metrics" / "prometheus.py").read_text()
    assert 'gauge("num_requests_waiting"' in src
