"""`python -m devstack.deploycheck`: every overlay builds and validates, offline (make lint).

- **kustomize build.** No kustomize installs from PyPI for Python 3.11 (`pykustomize`
  needs 3.14; the `kustomize` package is a manifest DSL, not a builder), so `build`
  renders the subset of kustomize the overlays use: `resources` (files and
  directories), `namespace`, `images` and JSON 6902 `patches` with a `target`. Anything
  else in a kustomization is refused, so a new feature cannot be silently ignored; a
  test compares the result with `kubectl kustomize` where kubectl is installed.
- **Kubernetes kinds** against the API's schemas (kubernetes-validate, strict: an
  unknown field is an error).
- **Custom resources** against their CRDs' schemas, vendored in deploy/schemas/ and
  made strict the same way: CloudNativePG 1.30.0 (cnpg-1.30.0.json), its Barman
  Cloud plugin 0.14.0 (barman-cloud-0.14.0.json, the `ObjectStore`) and the Prometheus
  Operator 0.93.0 (prometheus-operator-0.93.0.json: `ServiceMonitor`, `PodMonitor`,
  `PrometheusRule`).
- **docker-compose.yml** against the compose specification (deploy/schemas/compose-spec.json).

Lint and test tooling only: it needs the dev dependencies (jsonpatch,
kubernetes-validate), which the image does not install.
"""

from __future__ import annotations

import copy
import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonpatch
import jsonschema
import kubernetes_validate
import yaml

Manifest = dict[str, Any]

K8S_VERSION = "1.33.0"
# Vendored with the repository (this file is libs/devstack/devstack/deploycheck.py).
SCHEMAS = Path(__file__).resolve().parents[3] / "deploy" / "schemas"
OVERLAYS = Path("deploy/k8s/overlays")
KNOWN_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
CLUSTER_SCOPED = {"Namespace"}
# One file per operator release, each `{"apiVersion", "kinds": {kind: openAPIV3Schema}}`.
CRD_SCHEMAS = (
    "cnpg-1.30.0.json",
    "barman-cloud-0.14.0.json",
    "prometheus-operator-0.93.0.json",
)


class KustomizeError(ValueError):
    """A kustomization uses a feature this renderer does not implement, or is wrong."""


def build(directory: Path) -> list[Manifest]:
    """What `kustomize build directory` gives, for the features the overlays use."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN_FIELDS
    if unknown:
        raise KustomizeError(f"{directory}: unsupported kustomization fields {sorted(unknown)}")
    docs: list[Manifest] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        if path.is_dir():
            docs += build(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        _apply_patch(docs, patch, directory)
    for image in kustomization.get("images", []):
        _set_image(docs, image)
    namespace = kustomization.get("namespace")
    if namespace:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
    return docs


def _apply_patch(docs: list[Manifest], patch: dict[str, Any], directory: Path) -> None:
    if set(patch) != {"target", "patch"} or not set(patch["target"]) <= {"kind", "name"}:
        raise KustomizeError(f"{directory}: only inline JSON 6902 patches with a kind/name target")
    ops = jsonpatch.JsonPatch(yaml.safe_load(patch["patch"]))
    target = patch["target"]
    matched = [
        i
        for i, doc in enumerate(docs)
        if doc["kind"] == target["kind"]
        and target.get("name", doc["metadata"]["name"]) == doc["metadata"]["name"]
    ]
    if not matched:
        raise KustomizeError(f"{directory}: patch target {target} matches no resource")
    for i in matched:
        docs[i] = ops.apply(docs[i])


def _set_image(docs: list[Manifest], image: dict[str, str]) -> None:
    new = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for doc in docs:
        spec = doc.get("spec", {})
        pod = spec.get("template", {}).get("spec", {}) or spec.get("jobTemplate", {})
        for container in [*pod.get("containers", []), *pod.get("initContainers", [])]:
            if container["image"].split(":")[0] == image["name"]:
                container["image"] = new


@cache
def _crd_schemas() -> dict[str, dict[str, Any]]:
    """The vendored custom resources' schemas, strict, by apiVersion then kind."""
    schemas: dict[str, dict[str, Any]] = {}
    for name in CRD_SCHEMAS:
        vendored = json.loads((SCHEMAS / name).read_text())
        kinds = {k: _strict(s) for k, s in vendored["kinds"].items()}
        schemas.setdefault(vendored["apiVersion"], {}).update(kinds)
    return schemas


def _strict(schema: Any) -> Any:
    """The CRD's schema, refusing unknown fields as the API server's strict validation does
    (a CRD schema allows them: the server prunes them silently)."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {k: _strict(v) for k, v in schema.items()}
    pattern = strict.get("pattern")
    if isinstance(pattern, str) and pattern.startswith("^(?i)"):
        # Go's regexp takes a flag group anywhere; Python's only at the start
        # (the Prometheus Operator's `partial_response_strategy`).
        strict["pattern"] = "(?i)^" + pattern[len("^(?i)") :]
    if (
        "properties" in strict
        and "additionalProperties" not in strict
        and not strict.get("x-kubernetes-preserve-unknown-fields")
    ):
        strict["additionalProperties"] = False
    return strict


def validate(doc: Manifest) -> None:
    """Raise on a manifest the cluster would refuse (or silently prune)."""
    crds = _crd_schemas()
    if doc["apiVersion"] in crds:
        kinds = crds[doc["apiVersion"]]
        if doc["kind"] not in kinds:
            raise kubernetes_validate.SchemaNotFoundError(
                doc["kind"], "vendored", doc["apiVersion"]
            )
        schema = copy.deepcopy(kinds[doc["kind"]])
        # The CRD leaves metadata to the API server: any object's metadata.
        schema["properties"]["metadata"] = {"type": "object"}
        jsonschema.validate(doc, schema)
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def validate_compose(path: Path) -> None:
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    # Draft 7, which the spec declares (its $schema URL lacks the `#` jsonschema matches).
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load(path.read_text()))


def check(root: Path) -> list[str]:
    """Every problem in the overlays and the compose file under `root` (none: all valid)."""
    problems = []
    for overlay in sorted((root / OVERLAYS).iterdir()):
        try:
            docs = build(overlay)
        except (KustomizeError, jsonpatch.JsonPatchException, OSError) as exc:
            problems.append(f"{overlay.name}: does not build: {exc}")
            continue
        for doc in docs:
            where = f"{overlay.name}: {doc['kind']}/{doc['metadata']['name']}"
            try:
                validate(doc)
            except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
                problems.append(f"{where}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(f"{where}: no schema for {doc['apiVersion']} {doc['kind']}")
    try:
        validate_compose(root / "docker-compose.yml")
    except jsonschema.ValidationError as exc:
        problems.append(f"docker-compose.yml: {exc.message}")
    return problems


def main() -> int:
    problems = check(Path.cwd())
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print("deploy: every overlay builds and validates; docker-compose.yml validates")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
