"""The generation path imports no torch until a torch code path runs (issue 11: torch alone is ~220 MiB
of RSS, so a torch-free runner only helps if nothing else pulls it in).

Each entry point is imported in a fresh interpreter with an import hook that, at the first attempt to
import torch, prints the chain of runlm frames that asked for it and exits: the failure names the culprit.
"""
from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import runlm.engine

# the modules that ARE the torch path: only ever imported lazily, by what builds or runs a torch model
TORCH_PATH = {"runlm.engine.runners.torch_runner", "runlm.engine.sample.sampler", "runlm.engine.spec_decode.draft_torch",
              "runlm.engine.sample.rejection", "runlm.engine.runners.pooling", "runlm.engine.runners.gpu",
              "runlm.engine.runners.gpu_sampler", "runlm.engine.runners.gpu_verify", "runlm.engine.runners.tp_group",
              "runlm.engine.runners.tp_runner", "runlm.engine.runners.gpu_offload", "runlm.engine.runners.tp_gpu",
              "runlm.engine.runners.tp_worker"}

_HOOK = textwrap.dedent("""
    import importlib.abc, os, sys, traceback

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "torch" or name.startswith("torch."):
                chain = [f"{f.filename}:{f.lineno} {f.line}" for f in traceback.extract_stack()
                         if "/runlm/" in f.filename]
                print("torch imported via:\\n  " + "\\n  ".join(chain), file=sys.stderr, flush=True)
                os._exit(3)  # not an ImportError: an `except ImportError` must not hide it
            return None

    sys.meta_path.insert(0, NoTorch())
""")


def _engine_modules() -> list[str]:
    names = [m.name for m in pkgutil.walk_packages(runlm.engine.__path__, "runlm.engine.")]
    return [n for n in names if n not in TORCH_PATH]


ENTRY_POINTS = {
    "engine": "\n".join(f"import {m}" for m in _engine_modules()),
    "formats_models": textwrap.dedent("""
        import pkgutil, importlib, runlm.formats, runlm.tools
        for pkg in (runlm.formats, runlm.tools):
            for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                importlib.import_module(m.name)
        import runlm.models.config, runlm.models.load, runlm.kv_size, runlm.sizes, runlm.dtypes
        from runlm.engine.types.config import EngineConfig, dtype_itemsize
        assert dtype_itemsize(EngineConfig(model="m").dtype) == 4
    """),
    "cli_help": textwrap.dedent("""
        from runlm.cli import main
        for argv in (["--help"], ["serve-engine", "--help"], ["run", "--help"]):
            try:
                main(argv)
            except SystemExit:
                pass
    """),
    "serve_engine_app": textwrap.dedent("""
        import runlm.cli.serve_engine
        from runlm.server import ServerSettings, build_app
        build_app(ServerSettings(served_model_names=["m"]), load_engine=lambda: None)
    """),
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_entry_point_imports_no_torch(name: str) -> None:
    code = _HOOK + ENTRY_POINTS[name] + "\nassert 'torch' not in sys.modules\nprint('ok')\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-4000:]


def test_hook_names_the_importer() -> None:
    """The check can fail: a torch-path module is caught, with the file that imported torch."""
    code = _HOOK + "import runlm.engine.runners.torch_runner\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 3 and "runlm/engine/runners/torch_runner.py" in res.stderr
