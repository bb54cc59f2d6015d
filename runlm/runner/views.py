"""Stored models as Docker Model Runner shows them (shared by the API and the CLI without a daemon)."""
from __future__ import annotations

import datetime as dt

from runlm.store import StoredModel


def unix_time(iso: str) -> int:
    return int(dt.datetime.fromisoformat(iso).timestamp())


def model_json(models: list[StoredModel]) -> dict:
    """One model (all its tags) in DMR's shape."""
    m = models[0]
    info = m.info
    return {"id": m.id, "tags": [str(x.name) for x in models], "created": unix_time(m.created),
            "config": {"format": info.format, "quantization": info.quantization, "parameters": info.parameter_size,
                       "architecture": info.architecture, "size": m.size, "context_size": info.context_length,
                       **({"experts": info.experts, "experts_used": info.experts_used} if info.experts else {}),
                       **({"components": info.components} if info.components else {}),
                       **({"sampling": info.sampling} if info.sampling else {})},
            **_registry(models)}


def _registry(models: list[StoredModel]) -> dict:
    """Per tag, the OCI manifest digest and the registry reference it was pulled from or pushed to."""
    out = {str(x.name): {"reference": oci.get("reference"), "digest": oci["manifest"]}
           for x in models if (oci := x.manifest.get("oci") or {}).get("manifest")}
    return {"registry": out} if out else {}


def group_by_id(models: list[StoredModel]) -> list[list[StoredModel]]:
    groups: dict[str, list[StoredModel]] = {}
    for m in models:
        groups.setdefault(m.id, []).append(m)
    return list(groups.values())
