"""llama.cpp's own batching server (``llama-server``), built from the llama-cpp-python source
distribution's ``vendor/llama.cpp`` with cmake and cached under ``.cache/llama-server/``.

The sdist is the one of the installed llama-cpp-python version (``pip download`` from PyPI, kept
under ``.cache/sdist/``); the build takes about 11 minutes on 2 cores, once. A second call finds
the binary and returns at once.

    .venv/bin/python bench/llama_server.py      # build (if needed) and print the binary's path
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"


def _without_amx() -> list[str]:
    """On a CPU with AMX, a native build's AMX kernels die with SIGSEGV on a prompt batch (llama.cpp as
    llama-cpp-python 0.3.36 ships it): build for AVX-512 and VNNI without them, as the Makefile's bench set-up does."""
    try:
        has_amx = "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
            "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_AMX_INT8=OFF"] if has_amx else []


def llama_cpp_source() -> Path:
    """``vendor/llama.cpp`` of the installed llama-cpp-python's sdist, downloaded and unpacked once."""
    v = version("llama-cpp-python")
    unpacked = CACHE / "sdist" / f"llama_cpp_python-{v}"
    source = unpacked / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    archive = CACHE / "sdist" / f"llama_cpp_python-{v}.tar.gz"
    if not archive.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={v}", "-d", str(archive.parent)], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(archive.parent, filter="data")
    return source


def llama_server() -> Path:
    """Path to the built ``llama-server`` binary, building it first if the cache has none."""
    v = version("llama-cpp-python")
    out = CACHE / "llama-server" / v
    binary = out / "bin" / "llama-server"
    if binary.is_file():
        return binary
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is needed to build llama-server (apt-get install cmake)")
    source = llama_cpp_source()
    build = out / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), *gen, "-DCMAKE_BUILD_TYPE=Release",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF",
                    *_without_amx()], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", "2"], check=True)
    built = next(build.rglob("llama-server"))
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, binary)
    return binary


if __name__ == "__main__":
    print(llama_server())
