"""Bearer token auth (the registry delegates to a token service): anonymous tokens for public pulls, tokens for
credentials, a mount's two scopes in one token, wrong credentials refused. The registry is real (CNCF
Distribution with ``auth: token``); the token service is tests/fixtures/token_server.py."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runlm.store import ModelStore
from runlm.store.oci import credentials
from runlm.store.oci.client import RegistryAuthError
from runlm.store.oci.transfer import package, push
from tests.fixtures import registry as registry_fixture
from tests.fixtures.registry import PASSWORD, USER, Registry

pytest.importorskip("cryptography", reason="the test token service signs its JWTs with cryptography")


@pytest.fixture(scope="module")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Registry, object]]:
    from tests.fixtures.token_server import TokenServer

    if not registry_fixture.available():
        pytest.skip("docker-registry (Debian's package of CNCF Distribution) is not installed")
    root = tmp_path_factory.mktemp("token-registry")
    tokens = TokenServer(root, USER, PASSWORD).start()
    reg = Registry(root, auth_config=tokens.registry_auth_config()).start()
    yield reg, tokens
    reg.stop()
    tokens.stop()


def test_bearer_tokens_anonymous_and_with_credentials(token_registry, tinycoder_gguf: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    reg, tokens = token_registry
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker"))
    owner = ModelStore(tmp_path / "owner")
    package(owner, tinycoder_gguf, "tiny")
    anonymous_push = pytest.raises(RegistryAuthError, match="denied|needs credentials|no anonymous")
    with anonymous_push:
        push(owner, "tiny", f"{reg.host}/public/tiny:v1", insecure=True)
    credentials.save(reg.host, credentials.Credentials(USER, PASSWORD), owner.home)
    push(owner, "tiny", f"{reg.host}/public/tiny:v1", insecure=True)
    assert any(r["authed"] and "repository:public/tiny:pull,push" in r["scope"] for r in tokens.requests)
    # a mount asks for both repositories in one token
    push(owner, "tiny", f"{reg.host}/team/tiny:v1", insecure=True)
    assert any(set(r["scope"]) == {"repository:team/tiny:pull,push", "repository:public/tiny:pull"}
               for r in tokens.requests)
    assert any("mount=sha256" in line and '" 201 ' in line for line in reg.access_log())
    # anyone may pull public/ with an anonymous token; team/ needs credentials
    anyone = ModelStore(tmp_path / "anyone")
    model = anyone.pull(f"{reg.host}/public/tiny:v1", insecure=True)
    assert anyone.model_path(model).read_bytes() == tinycoder_gguf.read_bytes()
    assert any(not r["authed"] and r["scope"] == ["repository:public/tiny:pull"] for r in tokens.requests)
    with pytest.raises(RegistryAuthError):
        anyone.pull(f"{reg.host}/team/tiny:v1", insecure=True)
    credentials.save(reg.host, credentials.Credentials(USER, "wrong"), anyone.home)
    with pytest.raises(RegistryAuthError, match="refused the credentials"):
        anyone.pull(f"{reg.host}/team/tiny:v1", insecure=True)
