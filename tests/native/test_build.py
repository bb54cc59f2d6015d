"""runlm.native.build: a torch-free import, a cached build that a second start only opens, and a library
that is reported unavailable (never raised) where it cannot be had."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runlm.native import build
from runlm.native.host import cpu_has_avx2_fma, libggml

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, **env: str) -> dict:
    """code's last printed line (JSON) from a fresh interpreter."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not (cpu_has_avx2_fma() and libggml() and build.compiler()),
                    reason="no AVX2/FMA, libggml-python or C++ compiler here")
def test_the_library_loads_without_importing_torch_and_a_second_start_builds_nothing(tmp_path: Path) -> None:
    code = """
import json, sys
from runlm.native import build, kernels
ok = kernels.available()
print(json.dumps({"ok": ok, "torch": "torch" in sys.modules, "path": str(build.library_path(
    build.libggml().cflags(), build.libggml().ldflags())), "threads": kernels.get_threads() if ok else 0}))
"""
    first = _run(code, RUNLM_KERNEL_CACHE=str(tmp_path))
    assert first["ok"] and not first["torch"] and first["threads"] >= 1
    library = Path(first["path"])
    assert library.is_file() and library.parent.parent == tmp_path
    assert [p.name for p in library.parent.iterdir()] == [library.name]  # no temporary file left behind
    built = library.stat().st_mtime_ns
    second = _run(code, RUNLM_KERNEL_CACHE=str(tmp_path), CXX="/nonexistent/c++")  # a build would fail
    assert second["ok"] and second["path"] == first["path"] and library.stat().st_mtime_ns == built


def test_no_kernels_means_unavailable_without_raising(tmp_path: Path) -> None:
    code = """
import json
from runlm.native import build, kernels
print(json.dumps({"ok": kernels.available(), "why": build.why_unavailable, "features": kernels.cpu_features(),
                  "supported": kernels.supported(12)}))
"""
    off = _run(code, RUNLM_NO_KERNELS="1", RUNLM_KERNEL_CACHE=str(tmp_path))
    assert off == {"ok": False, "why": "RUNLM_NO_KERNELS is set", "features": "", "supported": False}
    no_compiler = _run(code, RUNLM_KERNEL_CACHE=str(tmp_path), CXX="/nonexistent/c++")
    assert not no_compiler["ok"] and no_compiler["why"]
    assert list(tmp_path.rglob("*.so")) == []


def test_a_build_error_is_reported_by_its_first_error_line(tmp_path: Path) -> None:
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'native_abi.cpp:1:1: error: the compiler says no' >&2\nexit 1\n")
    fake.chmod(0o755)
    code = """
import json
from runlm.native import build, kernels
print(json.dumps({"ok": kernels.available(), "why": build.why_unavailable}))
"""
    out = _run(code, RUNLM_KERNEL_CACHE=str(tmp_path / "cache"), CXX=str(fake))
    if not (cpu_has_avx2_fma() and libggml()):
        assert not out["ok"]
        return
    assert out == {"ok": False, "why": "could not build native_abi.cpp: native_abi.cpp:1:1: error: the compiler says no"}
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []  # the temporary file is gone


def test_the_int8_dot_product_instruction_is_chosen_from_the_cpus_flags() -> None:
    from runlm.native.host import CFLAGS, cpu_flags, vnni_cflags

    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    assert "-mavx512vnni" in vnni_cflags(avx512) and "-mprefer-vector-width=256" in vnni_cflags(avx512)
    assert vnni_cflags(avx512 - {"avx512vl"}) == []  # (the 256-bit forms need VL)
    assert vnni_cflags({"avx2", "fma", "avx_vnni"}) == ["-mavxvnni"]
    assert vnni_cflags({"avx2", "fma"}) == [] and vnni_cflags(None) == []
    assert all(flag in CFLAGS for flag in vnni_cflags(cpu_flags()))  # this machine's builds use its own
