"""Serving options llama-server and vLLM users bring: several API keys (repeated, comma-separated, a key file),
HTTPS with a key and certificate on both servers, a server-wide chat template file."""
from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from runlm.cli import build_parser
from runlm.cli.arguments import serving_keys_and_tls
from runlm.store import ModelStore
from runlm.web.api_key import read_api_keys
from tests.runner.daemon import Daemon, runlm
from tests.server.process import ServerProcess


def _certificate(tmp: Path) -> tuple[Path, Path]:
    key, cert = tmp / "key.pem", tmp / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return key, cert


def test_keys_from_flags_commas_and_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "keys"
    file.write_text("# team keys\nk3\n\n  k4  \nk1\n")
    assert read_api_keys(["k1", "k2, k5"], str(file)) == ("k1", "k2", "k5", "k3", "k4")
    assert read_api_keys(None, None, "from-env") == ("from-env",)
    assert read_api_keys(["a"], None, "from-env") == ("a",)  # the environment's only where none is given
    with pytest.raises(ValueError, match="cannot be read"):
        read_api_keys(None, str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_api_keys(None, str(tmp_path / "empty"))
    args = build_parser().parse_args(["serve", "--ssl-keyfile", str(file)])
    with pytest.raises(ValueError, match="go together"):
        serving_keys_and_tls(args)


def test_daemon_takes_any_of_its_keys_and_serves_https(tmp_path: Path) -> None:
    key, cert = _certificate(tmp_path)
    (tmp_path / "keys").write_text("second\n")
    store = ModelStore(tmp_path / "home")
    store.pull("tinycoder")
    d = Daemon(store.home, ("--api-key", "first", "--api-key-file", str(tmp_path / "keys"), "--ssl-keyfile", str(key),
                            "--ssl-certfile", str(cert)))
    d.start = _start_https(d, cert)  # type: ignore[method-assign]
    d.start()
    try:
        url = f"https://127.0.0.1:{d.port}"
        for k, status in (("first", 200), ("second", 200), ("third", 401)):
            r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {k}"}, verify=str(cert))
            assert r.status_code == status, k
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{d.port}/v1/models", timeout=5)  # plain HTTP is not answered
        ok = runlm(store.home, "ls", RUNLM_API_KEY="second")  # the CLI trusts its daemon's own certificate
        assert ok.returncode == 0 and "tinycoder:latest" in ok.stdout, ok.stderr
    finally:
        d.stop()


def _start_https(d: Daemon, cert: Path):
    """Daemon.start, waiting on the HTTPS address."""
    import sys
    import time

    from tests.runner.daemon import runlm_env

    def start() -> Daemon:
        d.home.mkdir(parents=True, exist_ok=True)
        d.log = open(d.home / "daemon-test.log", "wb")
        d.proc = subprocess.Popen([sys.executable, "-m", "runlm.cli", "serve", "--port", str(d.port), *d.args],
                                  stdout=d.log, stderr=subprocess.STDOUT, env=runlm_env(d.home))
        d.url = f"https://127.0.0.1:{d.port}"
        d.http = httpx.Client(base_url=d.url, timeout=60, verify=str(cert))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert d.proc.poll() is None, (d.home / "daemon-test.log").read_text()
            try:
                d.http.get("/")
                return d
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError("the daemon did not start")
    return start


def test_serve_engine_https_keys_and_chat_template_file(tmp_path: Path) -> None:
    key, cert = _certificate(tmp_path)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<<assistant>>{% endif %}")
    s = ServerProcess("tinycoder", ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--api-key", "a,b",
                                    "--chat-template-file", str(template), "--kv-cache-memory", "32MiB"],
                      verify=str(cert)).start()
    try:
        assert s.url.startswith("https://")
        for k in ("a", "b"):
            r = httpx.post(f"{s.url}/tokenize", verify=str(cert), headers={"Authorization": f"Bearer {k}"},
                           json={"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True})
            assert r.status_code == 200
        tokens = httpx.post(f"{s.url}/detokenize", verify=str(cert), headers={"Authorization": "Bearer a"},
                            json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert "<<user>>hi" in tokens and tokens.endswith("<<assistant>>")
    finally:
        s.stop()
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    out = runlm(tmp_path, "serve-engine", "tinycoder", "--chat-template-file", str(bad), timeout=120)
    assert out.returncode == 1 and "not a usable chat template" in out.stderr
