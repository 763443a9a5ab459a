#!/usr/bin/env python3
"""Vendor the OpenAPI schemas of KubeRay's RayCluster and RayJob CRDs into the repo, so
``tests/project/test_kuberay_manifests.py`` validates ``cluster/kuberay/*.yaml`` on a clean clone
(CI has no copy of the CRDs and no network).

    python cluster/kuberay/vendor_crds.py                      # from /work/shared/kuberay-crd
    python cluster/kuberay/vendor_crds.py --src DIR --out tests/data/kuberay-crd

``--src`` holds the CRDs as KubeRay publishes them, one file per release and kind:
``v1.5.1-rayclusters.yaml``, ``v1.5.1-rayjobs.yaml``, ... Only
``spec.versions[name=v1].schema.openAPIV3Schema`` of each is kept, unchanged, as compact
gzipped JSON (``v1.5.1-rayclusters.json.gz``, ~20 kB each instead of ~1 MB of YAML);
the gzip header carries no timestamp, so re-running it on the same input changes no file.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SRC = Path("/work/shared/kuberay-crd")
DEFAULT_OUT = ROOT / "tests" / "data" / "kuberay-crd"
NAME = re.compile(r"^(v\d+\.\d+\.\d+)-(rayclusters|rayjobs)\.yaml$")


def v1_schema(crd_path: Path) -> dict:
    """The ``ray.io/v1`` OpenAPI schema of one CRD file. Raises ValueError naming the
    file when it holds no CustomResourceDefinition with a ``v1`` version."""
    for doc in yaml.load_all(crd_path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        if not isinstance(doc, dict) or doc.get("kind") != "CustomResourceDefinition":
            continue
        for version in doc["spec"]["versions"]:
            if version["name"] == "v1":
                return version["schema"]["openAPIV3Schema"]
    raise ValueError(f"{crd_path}: no CustomResourceDefinition with a v1 version")


def write_gz_json(obj: dict, out: Path) -> int:
    """Write ``obj`` as compact, key-sorted JSON, gzipped with mtime 0 (reproducible).
    Returns the compressed size in bytes."""
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(raw)
    out.write_bytes(buf.getvalue())
    return len(buf.getvalue())


def vendor(src: Path, out: Path) -> list[Path]:
    """Write one ``<release>-<kind>.json.gz`` per CRD file in ``src``; returns them."""
    files = sorted(p for p in src.iterdir() if NAME.match(p.name))
    if not files:
        raise SystemExit(f"{src}: no <release>-rayclusters.yaml / -rayjobs.yaml CRD files")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for p in files:
        target = out / (p.name.removesuffix(".yaml") + ".json.gz")
        size = write_gz_json(v1_schema(p), target)
        print(f"{p} -> {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target} ({size} bytes)")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", type=Path, default=DEFAULT_SRC, help="CRD YAMLs (default %(default)s)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the schemas go (default %(default)s)")
    args = ap.parse_args(argv)
    if not args.src.is_dir():
        print(f"vendor_crds: --src {args.src} is not a directory; pass the folder holding "
              "KubeRay's CRD YAMLs", file=sys.stderr)
        return 2
    vendor(args.src, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
