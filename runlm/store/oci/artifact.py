"""A stored model as an OCI artifact (Model Runner's config and manifest), and a pulled manifest as files.

Writing follows docker/model-runner's builder: a lone GGUF file gets a v0.1 config and ``gguf.v3``
layers; a model folder gets a v0.2 config with one layer per file, its path in an annotation. Reading
accepts those, Ollama's ``vnd.ollama.image.*`` layers, and any layer that names its file.
"""
from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from runlm.store.blobs import check_digest
from runlm.store.metadata import ModelInfo
from runlm.store.mmproj import PROJECTOR_TYPES
from runlm.store.oci import media


class ArtifactError(ValueError):
    """A manifest runlm cannot turn into a model (no weights, a path that leaves the model, an unknown kind)."""


@dataclass(slots=True)
class Layer:
    path: str        # where the file goes in the model's folder
    digest: str
    size: int
    media_type: str
    annotations: dict[str, str] = field(default_factory=dict)

    def descriptor(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            d["annotations"] = self.annotations
        return d


def _human(n: float, units: tuple[str, ...], step: float) -> str:
    for unit in units[:-1]:
        if abs(n) < step:
            return f"{n:.2f}{unit}"
        n /= step
    return f"{n:.2f}{units[-1]}"


def model_layers(files: list[dict], created: str) -> list[Layer]:
    """Layers for a stored model's files (weights first, as Model Runner orders them)."""
    layers = []
    for f in files:
        mtype = f.get("media_type") or media.dmr_file_type(f["path"])
        meta = {"name": PurePosixPath(f["path"]).name, "mode": 0o644, "uid": 0, "gid": 0, "size": f["size"],
                "mtime": created, "typeflag": 0}
        annotations = {media.ANNOTATION_FILEPATH: f["path"],
                       media.ANNOTATION_FILE_METADATA: json.dumps(meta, separators=(",", ":")),
                       media.ANNOTATION_MEDIATYPE_UNTESTED: "false"}
        layers.append(Layer(f["path"], f["digest"], f["size"], mtype, annotations))
    weights = (media.DMR_GGUF, media.DMR_SAFETENSORS)
    return sorted(layers, key=lambda la: la.media_type not in weights)


def config_blob(info: ModelInfo, layers: list[Layer], created: str, context_size: int | None,
                gguf_metadata: dict[str, str] | None) -> bytes:
    """Model Runner's config file: what the model is, when it was made, and the layers' diff ids."""
    size = sum(la.size for la in layers if la.media_type in (media.DMR_GGUF, media.DMR_SAFETENSORS))
    config: dict[str, Any] = {
        "format": info.format, "quantization": info.quantization,
        "parameters": _human(info.parameters, ("", "K", "M", "B", "T"), 1000.0),
        "architecture": info.architecture, "size": _human(size, ("B", "KiB", "MiB", "GiB", "TiB"), 1024.0)}
    if gguf_metadata:
        config["gguf"] = gguf_metadata
    if context_size:
        config["context_size"] = context_size
    body = {"config": config, "descriptor": {"created": created},
            "rootfs": {"type": "rootfs", "diff_ids": [la.digest for la in layers]}}
    return json.dumps(body, separators=(",", ":")).encode()


def manifest_blob(config_media_type: str, config_digest: str, config_size: int, layers: list[Layer]) -> bytes:
    body = {"schemaVersion": 2, "mediaType": media.OCI_MANIFEST,
            "config": {"mediaType": config_media_type, "digest": config_digest, "size": config_size},
            "layers": [la.descriptor() for la in layers]}
    return json.dumps(body, separators=(",", ":")).encode()


def gguf_metadata_strings(metadata: dict[str, object], max_array: int = 50) -> dict[str, str]:
    """GGUF header values as strings, long arrays (vocabularies) left out, as Model Runner's config has them."""
    out = {}
    for key, value in metadata.items():
        if isinstance(value, list | tuple):
            if len(value) > max_array:
                continue
            value = "[" + ", ".join(str(v) for v in value) + "]"
        elif hasattr(value, "tolist"):  # numpy arrays and scalars
            listed = value.tolist()
            if isinstance(listed, list) and len(listed) > max_array:
                continue
            value = listed
        out[key] = value if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    return out


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# --- reading ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class Plan:
    """What a pulled manifest becomes: files in the store, and whether the model is one file or a folder."""
    layers: list[Layer]
    layout: str  # "file" or "dir"
    kind: str    # "docker-model-runner", "ollama" or "oci"


def safe_path(path: str) -> str:
    """A layer's file path, refused if it could leave the model's folder or hide in it."""
    parts = PurePosixPath(path.replace("\\", "/")).parts
    if not parts or path.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts) \
            or len(path) > 512:
        raise ArtifactError(f"a layer names the file path {path!r}, which is not a plain relative path")
    return "/".join(parts)


def unique_path(path: str, taken: set[str]) -> str:
    stem, dot, ext = path.rpartition(".") if "." in PurePosixPath(path).name else (path, "", "")
    n, out = 2, path
    while out in taken:
        out = f"{stem}-{n}{dot}{ext}" if dot else f"{path}-{n}"
        n += 1
    taken.add(out)
    return out


def plan(manifest: dict[str, Any]) -> Plan:
    config_type = str(manifest.get("config", {}).get("mediaType", ""))
    raw_layers = manifest.get("layers")
    if not isinstance(raw_layers, list):
        raise ArtifactError("the manifest has no layers")
    kind = "docker-model-runner" if config_type.startswith("application/vnd.docker.ai.") else \
        "ollama" if any(str(la.get("mediaType", "")).startswith(media.OLLAMA_PREFIX) for la in raw_layers) else "oci"
    ggufs = sum(1 for la in raw_layers if la.get("mediaType") in (media.DMR_GGUF, media.OLLAMA_PREFIX + "model"))
    taken: set[str] = set()
    layers: list[Layer] = []
    for i, la in enumerate(raw_layers):
        mtype = str(la.get("mediaType", ""))
        try:
            digest, size = check_digest(str(la.get("digest"))), int(la["size"])
        except (ValueError, KeyError, TypeError):
            raise ArtifactError(f"layer {i} has no valid sha256 digest and size") from None
        if size < 0:
            raise ArtifactError(f"layer {i} has a negative size")
        ann = la.get("annotations") or {}
        named = ann.get(media.ANNOTATION_FILEPATH) or ann.get(media.ANNOTATION_TITLE)
        if mtype in (media.DMR_DIR_TAR, media.DMR_VLLM_CONFIG_TAR):
            raise ArtifactError(f"layer {i} is a tar archive ({mtype}); runlm reads models packaged one file per "
                                f"layer (Model Runner's v0.2 folders, GGUF files)")
        if named:
            path = safe_path(str(named))
        elif mtype.startswith(media.OLLAMA_PREFIX):
            base = mtype.removeprefix(media.OLLAMA_PREFIX).split(";")[0]
            if base not in media.OLLAMA_FILES:
                continue  # a layer kind runlm has no use for (Ollama adds new ones over time)
            path = media.OLLAMA_FILES[base]
        elif mtype == media.DMR_GGUF:
            path = "model.gguf" if ggufs == 1 else f"model-{len(layers) + 1:05d}-of-{ggufs:05d}.gguf"
        elif mtype == media.DMR_LICENSE:
            path = "LICENSE"
        elif mtype == media.DMR_MMPROJ:
            path = "model.mmproj"
        elif mtype == media.DMR_CHAT_TEMPLATE:
            path = "template.jinja"
        else:
            continue  # unnamed layers of other kinds say nothing runlm can place
        layers.append(Layer(unique_path(path, taken), digest, size, mtype, {k: str(v) for k, v in ann.items()}))
    weights = [la for la in layers if la.path.endswith((".gguf", ".safetensors"))
               and la.media_type.split(";")[0] not in PROJECTOR_TYPES]
    if not weights:
        raise ArtifactError("the manifest has no GGUF or safetensors layer: not a model runlm can run")
    # one GGUF model: a file, or a split model's shards (llama.cpp's -0000K-of-0000N names order them)
    gguf_model = all(w.path.endswith(".gguf") for w in weights)
    if gguf_model:  # the model file first: a one-file model's path is its first file (a split model's first shard)
        shards = sorted(weights, key=lambda w: w.path)
        layers = shards + [la for la in layers if la not in shards]
    return Plan(layers, "file" if gguf_model else "dir", kind)
