"""OCI media types runlm writes and reads.

Docker Model Runner's types are those of docker/model-runner ``pkg/distribution/types/config.go``;
Ollama's registry uses a Docker v2 manifest whose layers carry ``application/vnd.ollama.image.*``.
"""
from __future__ import annotations

# manifests
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = (OCI_MANIFEST, DOCKER_MANIFEST)
ACCEPT = ", ".join((OCI_MANIFEST, DOCKER_MANIFEST, OCI_INDEX, DOCKER_MANIFEST_LIST))

# Docker Model Runner: v0.1 configs describe GGUF files (plus license, template, mmproj layers); v0.2 configs
# describe a folder, one layer per file, each with its path in an annotation
DMR_CONFIG_V01 = "application/vnd.docker.ai.model.config.v0.1+json"
DMR_CONFIG_V02 = "application/vnd.docker.ai.model.config.v0.2+json"
DMR_GGUF = "application/vnd.docker.ai.gguf.v3"
DMR_SAFETENSORS = "application/vnd.docker.ai.safetensors"
DMR_LICENSE = "application/vnd.docker.ai.license"
DMR_MMPROJ = "application/vnd.docker.ai.mmproj"
DMR_CHAT_TEMPLATE = "application/vnd.docker.ai.chat.template.jinja"
DMR_MODEL_FILE = "application/vnd.docker.ai.model.file"
DMR_DIR_TAR = "application/vnd.docker.ai.dir.tar"
DMR_VLLM_CONFIG_TAR = "application/vnd.docker.ai.vllm.config.tar"
ANNOTATION_FILEPATH = "org.cncf.model.filepath"
ANNOTATION_FILE_METADATA = "org.cncf.model.file.metadata+json"
ANNOTATION_MEDIATYPE_UNTESTED = "org.cncf.model.file.mediatype.untested"
ANNOTATION_TITLE = "org.opencontainers.image.title"  # ORAS' file name

# Ollama
OLLAMA_CONFIG = "application/vnd.docker.container.image.v1+json"
OLLAMA_PREFIX = "application/vnd.ollama.image."
OLLAMA_FILES = {  # layer kind -> the file it becomes in runlm's store
    "model": "model.gguf", "projector": "mmproj.gguf", "adapter": "adapter.gguf",
    "template": "template.txt", "system": "system.txt", "params": "params.json",
    "license": "LICENSE", "messages": "messages.json",
}

LICENSE_WORDS = ("license", "licence", "copying", "notice")


def dmr_file_type(rel_path: str) -> str:
    """Model Runner's media type for one file of a model folder (its files/classify.go rules)."""
    lower = rel_path.rsplit("/", 1)[-1].lower()
    if lower.endswith(".gguf"):
        return DMR_GGUF
    if lower.endswith(".safetensors"):
        return DMR_SAFETENSORS
    if lower.endswith(".jinja") or "chat_template" in lower:
        return DMR_CHAT_TEMPLATE
    if any(w in lower for w in LICENSE_WORDS):
        return DMR_LICENSE
    return DMR_MODEL_FILE
