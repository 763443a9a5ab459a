"""``cluster/kuberay/*.yaml`` are accepted by every KubeRay release their header claims.

Each ``ray.io/v1`` document is validated against the OpenAPI schema of its CRD, as
vendored from each release into ``tests/data/kuberay-crd/`` by
``cluster/kuberay/vendor_crds.py``. The API server prunes or (with strict field
validation, kubectl's default) rejects fields a CRD does not declare, so here an
unknown field is an error: ``additionalProperties: false`` wherever the schema lists
``properties`` and does not say ``x-kubernetes-preserve-unknown-fields``. Not checked:
the CEL rules (``x-kubernetes-validations``) and the operator's own webhook checks.
Fast: no cluster, no network.
"""

from __future__ import annotations

import copy
import gzip
import json
import re
from functools import lru_cache
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBERAY = ROOT / "cluster" / "kuberay"
SCHEMAS = ROOT / "tests" / "data" / "kuberay-crd"
MANIFESTS = {"RayCluster": KUBERAY / "raycluster.yaml", "RayJob": KUBERAY / "rayjob.yaml"}
PLURAL = {"RayCluster": "rayclusters", "RayJob": "rayjobs"}


def claimed_releases() -> list[str]:
    """The KubeRay releases the manifests say they support (``# KubeRay releases: ...``
    in raycluster.yaml's header): the ones this test must validate against."""
    m = re.search(r"KubeRay releases:\s*([v0-9., ]+)", MANIFESTS["RayCluster"].read_text())
    assert m, "raycluster.yaml's header must list the KubeRay releases it supports"
    return [v.strip() for v in m.group(1).split(",") if v.strip()]


RELEASES = claimed_releases()


def strict(schema: dict) -> dict:
    """A Kubernetes structural schema as a JSON Schema that refuses unknown fields.

    * ``properties`` without ``x-kubernetes-preserve-unknown-fields``: unknown keys are
      errors (``additionalProperties: false``), as the API server prunes/rejects them;
    * ``x-kubernetes-int-or-string``: an integer or a string (controller-gen also writes
      the ``anyOf``; added where it is missing);
    * ``nullable: true``: null is allowed too.
    """
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    # "properties" is a map of field names, made strict field by field below (walking it
    # here as well, as a schema, doubled the work at every nesting level: seconds a CRD).
    out = {k: (strict(v) if k not in ("enum", "default", "required", "properties") else v)
           for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema:
            out["additionalProperties"] = False
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in schema:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        out.pop("type", None)
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


@lru_cache(maxsize=None)
def validator(release: str, kind: str) -> jsonschema.Draft7Validator:
    path = SCHEMAS / f"{release}-{PLURAL[kind]}.json.gz"
    assert path.is_file(), (f"{path} missing: run `python cluster/kuberay/vendor_crds.py` "
                            "with the release's CRDs")
    return jsonschema.Draft7Validator(strict(json.loads(gzip.decompress(path.read_bytes()))))


def errors(release: str, doc: dict) -> list[str]:
    """Schema errors of one ``ray.io/v1`` document, each as ``path: message``."""
    v = validator(release, doc["kind"])
    return sorted(f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
                  for e in v.iter_errors(doc))


def ray_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text())
            if isinstance(d, dict) and d.get("apiVersion") == "ray.io/v1"]


def test_every_claimed_release_is_vendored():
    assert RELEASES == ["v1.5.1", "v1.6.0", "v1.7.0"]
    for rel in RELEASES:
        for plural in PLURAL.values():
            f = SCHEMAS / f"{rel}-{plural}.json.gz"
            assert f.is_file() and f.stat().st_size < 1_000_000, f
    # rayjob.yaml claims the same releases (it is used with raycluster.yaml).
    assert f"KubeRay releases: {', '.join(RELEASES)}" in MANIFESTS["RayJob"].read_text()


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("kind", sorted(MANIFESTS))
def test_manifest_validates_against_release(release, kind):
    docs = [d for d in ray_docs(MANIFESTS[kind]) if d["kind"] == kind]
    assert len(docs) == 1
    assert errors(release, docs[0]) == []


@pytest.mark.parametrize("release", RELEASES)
def test_planted_unknown_fields_are_refused(release):
    """The validation can fail: a misspelt field anywhere, at the top of the spec or deep
    in a pod template, and a field of a newer release, are each reported by path."""
    cluster = ray_docs(MANIFESTS["RayCluster"])[0]
    plants = {
        "spec.headGroupSpec.rayStartParam": lambda d: d["spec"]["headGroupSpec"].__setitem__("rayStartParam", {}),
        "spec.workerGroupSpecs.0.minReplica": lambda d: d["spec"]["workerGroupSpecs"][0].__setitem__("minReplica", 1),
        "spec.workerGroupSpecs.0.template.spec.containers.0.envv":
            lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].__setitem__("envv", []),
        "spec.authOptions.tokenSecret": lambda d: d["spec"]["authOptions"].__setitem__("tokenSecret", "x"),
    }
    for where, plant in plants.items():
        doc = copy.deepcopy(cluster)
        plant(doc)
        found = errors(release, doc)
        parent = where.rsplit(".", 1)[0]
        assert any(e.startswith(parent + ":") and "Additional properties" in e and where.rsplit(".", 1)[1] in e
                   for e in found), (where, found)
    job = copy.deepcopy(ray_docs(MANIFESTS["RayJob"])[0])
    job["spec"]["entrypointt"] = "x"
    assert any("entrypointt" in e for e in errors(release, job))


def test_a_field_of_a_newer_release_is_refused_by_the_older_one():
    """A field of one release only: ``authOptions.secretName`` exists only from
    KubeRay 1.6.0, so 1.5.1 refuses it while 1.6.0 accepts it."""
    doc = copy.deepcopy(ray_docs(MANIFESTS["RayCluster"])[0])
    doc["spec"]["authOptions"] = {"mode": "token", "secretName": "elastic-ddp-ray-token"}
    assert any(e.startswith("spec.authOptions:") and "secretName" in e for e in errors("v1.5.1", doc))
    assert errors("v1.6.0", doc) == []


def test_types_are_checked_too():
    """int-or-string quantities take both forms, a wrong type elsewhere is refused."""
    doc = copy.deepcopy(ray_docs(MANIFESTS["RayCluster"])[0])
    res = doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    res["limits"]["cpu"] = 4  # an integer quantity is valid Kubernetes
    assert errors("v1.5.1", doc) == []
    doc["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert any("replicas" in e for e in errors("v1.5.1", doc))
    doc["spec"]["workerGroupSpecs"][0]["replicas"] = 2
    res["limits"]["cpu"] = ["4"]
    assert any("limits.cpu" in e for e in errors("v1.5.1", doc))


def test_rayjob_runtime_env_is_valid_for_ray():
    from ray.runtime_env import RuntimeEnv

    job = ray_docs(MANIFESTS["RayJob"])[0]
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    # working_dir is the repo inside the image (RuntimeEnv checks that the path exists,
    # which it does only there).
    workdir = re.search(r"^WORKDIR (\S+)", (ROOT / "cluster" / "Dockerfile").read_text(), re.M).group(1)
    assert env.pop("working_dir") == workdir
    RuntimeEnv(**env)
    # Credentials reach the job from the cluster's pods (Kubernetes Secrets), never here.
    assert "MLFLOW_TRACKING_URI" not in env.get("env_vars", {})


def test_token_auth_uses_the_operator_secret_in_every_release():
    """``authOptions: {mode: token}`` (KubeRay >= 1.5.1) makes the operator create the
    Secret named after the cluster (key ``auth_token``) unless it exists, and set
    RAY_AUTH_MODE/RAY_AUTH_TOKEN on every Ray container, the autoscaler and the RayJob
    submitter; so no container sets them by hand (1.5.1 would append duplicates)."""
    cluster = ray_docs(MANIFESTS["RayCluster"])[0]
    assert cluster["spec"]["authOptions"] == {"mode": "token"}
    job = ray_docs(MANIFESTS["RayJob"])[0]
    containers = [c for g in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
                  for c in g["template"]["spec"]["containers"]]
    containers += job["spec"]["submitterPodTemplate"]["spec"]["containers"]
    for c in containers:
        names = {e["name"] for e in c.get("env", [])}
        assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}, c["name"]
    name = cluster["metadata"]["name"]
    readme = (ROOT / "cluster" / "README.md").read_text()
    assert f"secret generic {name} --from-literal=auth_token=" in readme
    assert f"kubectl get secret {name} -o jsonpath='{{.data.auth_token}}'" in readme


def test_worker_pods_drain_their_ray_node_before_they_stop():
    """Every worker group's pods run ``elastic-ddp drain-node --self`` as their preStop hook
    with a deadline inside the grace period (a margin left for Ray's own shutdown), and
    Ray's SIGTERM drain is bounded by the grace period too: an eviction is a notice."""
    from elastic_ddp.driver.cli import _parser

    cluster = ray_docs(MANIFESTS["RayCluster"])[0]
    for group in cluster["spec"]["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        grace = pod["terminationGracePeriodSeconds"]
        (c,) = pod["containers"]
        cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[:3] == ["elastic-ddp", "drain-node", "--self"], cmd
        args = _parser().parse_args(cmd[1:])  # the command this package ships accepts it
        assert args.self_node and 0 < args.deadline <= grace - 10, (args.deadline, grace)
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert 0 < float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"]) < grace


def test_the_disruption_budget_selects_the_worker_group():
    """cluster/kuberay/pdb.yaml selects the pods of raycluster.yaml's worker group by the
    labels KubeRay puts on them (ray.io/cluster: the cluster's name, ray.io/group: the
    group's name) and lets one go at a time."""
    (pdb,) = list(yaml.safe_load_all((KUBERAY / "pdb.yaml").read_text()))
    cluster = ray_docs(MANIFESTS["RayCluster"])[0]
    assert pdb["apiVersion"] == "policy/v1" and pdb["kind"] == "PodDisruptionBudget"
    labels = pdb["spec"]["selector"]["matchLabels"]
    assert labels["ray.io/cluster"] == cluster["metadata"]["name"]
    assert labels["ray.io/group"] in {g["groupName"] for g in cluster["spec"]["workerGroupSpecs"]}
    assert pdb["spec"]["maxUnavailable"] == 1


# --------------------------------------------------------------------------- storage
def _pods(cluster: dict) -> list[dict]:
    """The pod specs of the head and of every worker group."""
    return [cluster["spec"]["headGroupSpec"]["template"]["spec"]] + \
        [g["template"]["spec"] for g in cluster["spec"]["workerGroupSpecs"]]


def _entrypoint_overrides(job: dict) -> dict[str, str]:
    """The ``--set key=value`` pairs of a RayJob's ``elastic-ddp train`` entrypoint."""
    words = job["spec"]["entrypoint"].split()
    return dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--set")


def test_pods_reach_object_storage_as_their_service_account_with_no_key_in_the_manifest():
    """Object storage is the default: the job's data and checkpoints are s3:// URIs, every
    pod runs as the service account the file defines (the identity a cloud role binds
    to), and the S3 settings come only from an optional Secret: no literal endpoint or key
    in the manifest, and a pod starts without that Secret (IRSA / Workload Identity)."""
    docs = list(yaml.safe_load_all(MANIFESTS["RayCluster"].read_text()))
    cluster = ray_docs(MANIFESTS["RayCluster"])[0]
    accounts = {d["metadata"]["name"] for d in docs if d and d.get("kind") == "ServiceAccount"}
    assert not any(d and d.get("kind") == "PersistentVolumeClaim" for d in docs)
    for pod in _pods(cluster):
        assert pod["serviceAccountName"] in accounts
        (c,) = pod["containers"]
        assert not any(v.get("persistentVolumeClaim") for v in pod.get("volumes", []))
        aws = [e for e in c["env"] if e["name"].startswith("AWS_")]
        assert {e["name"] for e in aws} == {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        for e in aws:
            ref = e["valueFrom"]["secretKeyRef"]
            assert "value" not in e and ref["name"] == "elastic-ddp-storage" and ref["optional"] is True
    sets = _entrypoint_overrides(ray_docs(MANIFESTS["RayJob"])[0])
    for key in ("data.train_path", "data.val_path", "run.storage_path"):
        assert sets[key].startswith("s3://"), (key, sets[key])


def _json6902(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 ``add`` / ``replace`` operations (what kustomize applies for a patch of
    that form) on a copy of ``doc``; ``-`` appends to a list."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        assert op["op"] in ("add", "replace"), op
        if isinstance(node, list):
            if last == "-":
                node.append(op["value"])
            elif op["op"] == "add":
                node.insert(int(last), op["value"])
            else:
                node[int(last)] = op["value"]
        else:
            assert op["op"] == "add" or last in node, f"replace of a missing {op['path']}"
            node[last] = op["value"]
    return doc


def _shared_disk_overlay() -> dict[str, dict]:
    """cluster/kuberay/shared-disk built as ``kubectl apply -k`` builds it: its resources
    with its patches applied, by kind."""
    base = KUBERAY / "shared-disk"
    kust = yaml.safe_load((base / "kustomization.yaml").read_text())
    docs = [d for r in kust["resources"] for d in yaml.safe_load_all((base / r).read_text()) if d]
    out = {}
    for d in docs:
        for p in kust["patches"]:
            t = p["target"]
            if d["kind"] == t["kind"] and d["metadata"]["name"] == t["name"]:
                d = _json6902(d, yaml.safe_load(p["patch"]))
        out.setdefault(d["kind"], d)
    return out


@pytest.mark.parametrize("release", RELEASES)
def test_the_shared_disk_overlay_mounts_one_rwx_volume_everywhere(release):
    """The alternative to object storage (cluster/kuberay/shared-disk): every pod mounts
    the ReadWriteMany claim at /mnt/shared, the job's paths lie under it, its other
    settings are the base job's, and both documents still validate against the release."""
    built = _shared_disk_overlay()
    cluster, job, pvc = built["RayCluster"], built["RayJob"], built["PersistentVolumeClaim"]
    assert errors(release, cluster) == [] and errors(release, job) == []
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for pod in _pods(cluster):
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                  for v in pod["volumes"] if "persistentVolumeClaim" in v}
        (c,) = pod["containers"]
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert claims[mounts["/mnt/shared"]] == pvc["metadata"]["name"]
    base = _entrypoint_overrides(ray_docs(MANIFESTS["RayJob"])[0])
    sets = _entrypoint_overrides(job)
    paths = ("data.train_path", "data.val_path", "run.storage_path")
    assert all(sets[k].startswith("/mnt/shared/") for k in paths), sets
    assert {k: v for k, v in sets.items() if k not in paths} == \
        {k: v for k, v in base.items() if k not in paths}
    assert job["spec"]["entrypoint"].split()[:3] == ray_docs(MANIFESTS["RayJob"])[0]["spec"]["entrypoint"].split()[:3]
