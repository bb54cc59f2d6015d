"""Registry references: ``[oci://]host[:port]/path/name[:tag][@sha256:hex]``.

A reference must name its registry (a host with a dot or a port, or ``localhost``), so it can never be
mistaken for a Hugging Face repo id (``org/name``); ``oci://`` makes any ``host/name`` one.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from runlm.store.blobs import check_digest

_HOST = re.compile(r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
                   r"(?::[0-9]{1,5})?|\[[0-9a-fA-F:]+\](?::[0-9]{1,5})?")
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*")  # the distribution spec's rule
_TAG = re.compile(r"[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}")
DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"
HF_HOSTS = ("hf.co", "huggingface.co")


class InvalidReferenceError(ValueError):
    """Text that is not a registry reference."""


@dataclass(slots=True, frozen=True)
class Reference:
    registry: str           # as written: host[:port]
    repository: str         # path/name
    tag: str | None = "latest"
    digest: str | None = None

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}" + (f":{self.tag}" if self.tag else "") + \
            (f"@{self.digest}" if self.digest else "")

    @property
    def api_host(self) -> str:
        return DOCKER_HUB_API if self.registry in (DOCKER_HUB, "index.docker.io") else self.registry

    @property
    def target(self) -> str:
        """What the manifest URL names: the digest when one was given, else the tag."""
        return self.digest or self.tag or "latest"

    def with_tag(self, tag: str) -> Reference:
        return Reference(self.registry, self.repository, tag, None)


def looks_like_reference(text: str) -> bool:
    text = text.strip()
    if text.startswith("oci://"):
        return True
    if "://" in text or text.startswith(("/", ".", "~")):
        return False
    parts = text.split("/")
    if len(parts) < 2 or not _HOST.fullmatch(parts[0]):
        return False
    host = parts[0]
    if host.lower() in HF_HOSTS:  # Hugging Face ids, which the store pulls through huggingface_hub
        return False
    return ":" in host or host == "localhost" or (len(parts) >= 3 and "." in host) or host == DOCKER_HUB


def parse_reference(text: str) -> Reference:
    raw = text.strip().removeprefix("oci://")
    rest, _, digest = raw.partition("@")
    host, sep, path = rest.partition("/")
    if not sep or not _HOST.fullmatch(host):
        raise InvalidReferenceError(f"{text!r} is not a registry reference: use host[:port]/name[:tag] "
                              f"(for example localhost:5000/models/smollm2:q4)")
    tag: str | None = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, _, tag = path.rpartition(":")
        if not _TAG.fullmatch(tag):
            raise InvalidReferenceError(f"invalid tag {tag!r} in {text!r}")
    components = path.split("/")
    if not path or not all(_PATH_COMPONENT.fullmatch(c) for c in components):
        raise InvalidReferenceError(f"invalid repository {path!r} in {text!r}: lowercase letters, digits and "
                              f"'.', '_', '-' separators, '/' between parts")
    if host in (DOCKER_HUB, "index.docker.io") and len(components) == 1:
        path = "library/" + path
    if digest:
        try:
            check_digest(digest)
        except ValueError as exc:
            raise InvalidReferenceError(f"{text!r}: {exc}") from None
    return Reference(host, path, tag or (None if digest else "latest"), digest or None)
