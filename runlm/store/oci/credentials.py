"""Registry credentials: ``runlm login`` keeps them in $RUNLM_HOME/registry-auth.json (mode 0600); Docker's
``~/.docker/config.json`` is read as well, runlm's own first: its ``auths`` (as ``docker login`` writes them
without a helper), then its ``credHelpers`` / ``credsStore`` through Docker's credential-helper protocol
(``docker-credential-NAME get``, the registry on stdin, JSON with Username and Secret on stdout)."""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from runlm.store.refs import default_home

AUTH_FILE = "registry-auth.json"


@dataclass(slots=True, frozen=True)
class Credentials:
    username: str
    password: str  # a password or a personal access token

    def __repr__(self) -> str:  # never print a secret in a log or a traceback
        return f"Credentials(username={self.username!r}, password=***)"

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


def _keys(registry: str) -> list[str]:
    """The spellings a config may use for one registry (Docker Hub has its own historic key)."""
    keys = [registry, f"https://{registry}", f"http://{registry}", f"https://{registry}/v1/", f"https://{registry}/v2/"]
    if registry in ("docker.io", "index.docker.io", "registry-1.docker.io"):
        keys.append("https://index.docker.io/v1/")
    return keys


def _decode(entry: object) -> Credentials | None:
    if not isinstance(entry, dict):
        return None
    if entry.get("username") and entry.get("password"):
        return Credentials(str(entry["username"]), str(entry["password"]))
    try:
        user, sep, password = base64.b64decode(str(entry.get("auth", ""))).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return Credentials(user, password) if sep and user else None


def _config(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _auths(path: Path) -> dict:
    auths = _config(path).get("auths")
    return auths if isinstance(auths, dict) else {}


def _from_helper(registry: str, config: dict) -> Credentials | None:
    """Ask Docker's credential helper for ``registry`` (the one named for it, else the default store)."""
    found = config.get("credHelpers")
    helpers: dict = found if isinstance(found, dict) else {}
    name = next((helpers[k] for k in _keys(registry) if k in helpers), None) or config.get("credsStore")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        return None
    exe = shutil.which(f"docker-credential-{name}")
    if exe is None:
        return None
    for key in (registry, f"https://{registry}"):
        try:
            out = subprocess.run([exe, "get"], input=key, capture_output=True, text=True, timeout=30)
            data = json.loads(out.stdout) if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
            data = None
        if isinstance(data, dict) and data.get("Username") and data.get("Secret"):
            return Credentials(str(data["Username"]), str(data["Secret"]))
    return None


def auth_file(home: Path | None = None) -> Path:
    return (home or default_home()) / AUTH_FILE


def docker_config() -> Path:
    return Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker").expanduser() / "config.json"


def lookup(registry: str, home: Path | None = None) -> Credentials | None:
    for path in (auth_file(home), docker_config()):
        auths = _auths(path)
        for key in _keys(registry):
            found = _decode(auths.get(key))
            if found:
                return found
    return _from_helper(registry, _config(docker_config()))


def save(registry: str, creds: Credentials, home: Path | None = None) -> Path:
    """Remember ``creds`` for ``registry`` in runlm's own file, readable by its owner alone."""
    path = auth_file(home)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    auths = _auths(path)
    auths[registry] = {"auth": base64.b64encode(f"{creds.username}:{creds.password}".encode()).decode()}
    _write(path, auths)
    return path


def forget(registry: str, home: Path | None = None) -> bool:
    path = auth_file(home)
    auths = _auths(path)
    if registry not in auths:
        return False
    del auths[registry]
    _write(path, auths)
    return True


def _write(path: Path, auths: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{AUTH_FILE}.")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"auths": auths}, f, indent=1)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
