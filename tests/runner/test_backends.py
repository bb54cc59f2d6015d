"""Backend protocol: statuses, memory estimates, the command lines they would run."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from runlm.runner.backends import all_backends
from runlm.runner.backends.base import BackendError
from runlm.runner.backends.native import draft_bytes, kv_cache_bytes
from runlm.runner.config import BackendConfig, BackendMode, ConfigError
from runlm.sizes import gpu_memory
from runlm.store import ModelStore

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory):
    store = ModelStore(tmp_path_factory.mktemp("home"))
    return store, store.pull("smollm2")


def test_statuses_follow_the_protocol(tmp_path: Path) -> None:
    backends = all_backends(tmp_path)
    assert set(backends) == {"native", "llamacpp", "vllm", "diffusers"}
    assert backends["native"].status().startswith("Running: runlm")
    for b in backends.values():
        assert b.status().split(":")[0] in ("Running", "Error", "Not Installed", "Installing")
        assert b.name == b.name.lower() and b.disk_usage() >= 0
    has_llamacpp = shutil.which("llama-server") or importlib.util.find_spec("llama_cpp")
    assert backends["llamacpp"].status().startswith("Running" if has_llamacpp else "Not Installed")
    assert backends["vllm"].status().startswith("Not Installed" if not importlib.util.find_spec("vllm") else "Running")


def test_absent_backends_refuse_to_run_clearly(tmp_path: Path) -> None:
    vllm = all_backends(tmp_path)["vllm"]
    if vllm.installed():
        pytest.skip("vllm is installed here")
    with pytest.raises(BackendError, match="Not Installed"):
        asyncio.run(vllm.run("/tmp/x.sock", "/m", "m", BackendMode.COMPLETION, BackendConfig()))
    with pytest.raises(BackendError, match="pip install vllm"):
        asyncio.run(vllm.install())


def test_native_memory_grows_with_context(stored, tmp_path: Path) -> None:
    store, model = stored
    native = all_backends(tmp_path)["native"]
    small = native.required_memory(model, BackendConfig(context_size=512))
    big = native.required_memory(model, BackendConfig(context_size=8192))
    per_token = model.info.kv_bytes_per_token(2)
    assert big.ram - small.ram == per_token * (8192 - 512) * 2  # two full-context sequences of fp16 KV (a GGUF's)
    fp32 = native.required_memory(model, BackendConfig(context_size=8192, runtime_flags=["--kv-cache-dtype", "fp32"]))
    assert fp32.ram - big.ram == per_token * 8192 * 2
    assert native.context_size(model, BackendConfig(context_size=100_000)) == 8192  # capped by the model


def test_a_gpu_runs_offloaded_layers_are_counted_in_ram(stored, tmp_path: Path) -> None:
    """Layer offload (--n-gpu-layers K): the layers before the last K, and their K/V, in RAM beside the GPU share;
    without the flag, what of the weights the share cannot hold (the engine splits the model so)."""
    from runlm.runner.backends.native import kv_cache_bytes, offloaded_bytes, weight_bytes

    store, model = stored
    native = all_backends(tmp_path)["native"]
    layers, weights = model.info.num_layers, weight_bytes(model)
    config = BackendConfig(context_size=1024, runtime_flags=["--n-gpu-layers", "10"])
    assert native.check_flags(config.runtime_flags) == ["--n-gpu-layers", "10"]
    kv = kv_cache_bytes(model, 1024, config)
    assert offloaded_bytes(model, config, 1 << 40, 1024) == (weights + kv) * (layers - 10) // layers > 0
    for flags in (["--n-gpu-layers", "-1"], ["--n-gpu-layers", str(layers)]):
        assert offloaded_bytes(model, BackendConfig(runtime_flags=flags), 1 << 40, 1024) == 0
    assert offloaded_bytes(model, BackendConfig(), weights // 3, 1024) == weights - weights // 3
    assert offloaded_bytes(model, BackendConfig(), weights, 1024) == 0
    for bad in ("0", "-2", "x", "99999"):
        with pytest.raises(ConfigError, match="needs a valid value"):
            native.check_flags(["--n-gpu-layers", bad])


def test_native_weight_estimate_is_what_the_engine_allocates(stored) -> None:
    from runlm.models.load import load_decoder
    from runlm.runner.backends.native import weight_bytes

    store, model = stored
    loaded = load_decoder(store.model_path(model)).model  # matrices stay as stored (Q4_1, Q8_0), norms float32
    assert weight_bytes(model) == sum(t.numel() * t.element_size() for t in loaded.weight_tensors())
    assert weight_bytes(model) < model.info.parameters * 0.8  # about the file's size, not float32's 4 bytes


def test_native_command_line(stored, tmp_path: Path) -> None:
    store, model = stored
    native = all_backends(tmp_path)["native"]
    argv = native.command("/s.sock", "/m.gguf", "smollm2:latest", model,
                          BackendConfig(context_size=1024, runtime_flags=["--max-num-seqs", "8"]))
    assert argv[argv.index("serve-engine") + 1] == "/m.gguf" and argv[argv.index("--uds") + 1] == "/s.sock"
    assert argv[argv.index("--max-model-len") + 1] == "1024" and argv[-2:] == ["--max-num-seqs", "8"]
    assert argv[argv.index("--device") + 1] == "auto"  # a GPU where there is one
    if gpu_memory() is None:  # on the CPU the daemon sizes the KV cache; on a GPU the engine's profile does
        assert "--kv-cache-memory" in argv and native.required_memory(model, BackendConfig()).vram == 0
    # the settings the store keeps for the model (smollm2's from the built-in catalogue) reach serve-engine
    assert model.info.sampling == {"temperature": 0.0, "top_p": 0.9, "dry_multiplier": 0.8}
    assert json.loads(argv[argv.index("--override-generation-config") + 1]) == model.info.sampling
    with pytest.raises(ConfigError, match="not allowed"):
        native.command("/s.sock", "/m.gguf", "x", model, BackendConfig(runtime_flags=["--api-key", "k"]))


def test_llamacpp_and_vllm_command_lines(stored, tmp_path: Path) -> None:
    store, model = stored
    b = all_backends(tmp_path)
    assert b["llamacpp"].uses_tcp and not b["vllm"].uses_tcp and not b["native"].uses_tcp
    cfg = BackendConfig(context_size=2048, gpu_memory_utilization=0.5, hf_overrides={"rope_theta": 1.0})
    argv = b["vllm"].command("/s.sock", "/m", "m:latest", BackendMode.EMBEDDING, cfg)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.5" and "--hf-overrides" in argv
    assert argv[argv.index("--task") + 1] == "embed"
    llama = b["llamacpp"].command("127.0.0.1:9999", "/m.gguf", "m", BackendMode.COMPLETION,
                                  BackendConfig(runtime_flags=["--threads", "2"]), model)
    assert "9999" in llama and "/m.gguf" in llama
    assert b["llamacpp"].required_memory(model, BackendConfig()).ram < \
        b["native"].required_memory(model, BackendConfig()).ram  # llama.cpp keeps the Q4 weights as stored


@pytest.mark.skipif(not (shutil.which("llama-server") or importlib.util.find_spec("llama_cpp")),
                    reason="llama.cpp is not installed here (runlm install-backend llamacpp)")
def test_llamacpp_serves_a_model(stored, tmp_path: Path) -> None:
    import httpx

    store, model = stored
    backend = all_backends(tmp_path)["llamacpp"]

    async def scenario() -> str:
        from runlm.runner.loader import _free_port

        address = f"127.0.0.1:{_free_port()}"
        task = asyncio.create_task(backend.run(address, str(store.model_path(model)), "smollm2:latest",
                                               BackendMode.COMPLETION, BackendConfig(context_size=512)))
        try:
            key = {"Authorization": f"Bearer {backend.api_key_for(address)}"}  # the daemon's own key for it
            async with httpx.AsyncClient(base_url=f"http://{address}", timeout=120, headers=key) as c:
                for _ in range(600):
                    try:
                        if (await c.get(backend.health_path)).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.2)
                else:
                    raise TimeoutError("llama.cpp did not become ready")
                body = {"model": "smollm2:latest", "max_tokens": 5, "prompt": "The capital of France is",
                        "temperature": 0}
                r = await c.post("/v1/completions", json=body)
                without_key = await c.post("/v1/completions", json=body, headers={"Authorization": ""})
                assert without_key.status_code == 401  # issue 15 #8: only the daemon can talk to it
                return r.json()["choices"][0]["text"]
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    assert asyncio.run(scenario()).strip()


def test_settings_a_backend_cannot_honour_are_refused(tmp_path: Path) -> None:
    b = all_backends(tmp_path)
    spec = BackendConfig.from_json({"speculative": {"draft_model": "tinycoder", "num_tokens": 4}})
    with pytest.raises(ConfigError, match="draft model"):
        b["diffusers"].check_config(spec)  # an image pipeline has no draft
    b["vllm"].check_config(spec)  # vLLM and the native engine take a draft model
    b["native"].check_config(spec)
    spec.speculative.draft_model_path = "/d"
    argv = b["vllm"].command("/s", "/m", "m", BackendMode.COMPLETION, spec)
    assert '"num_speculative_tokens": 4' in argv[argv.index("--speculative-config") + 1]
    argv = b["native"].command("/s", "/m", "m", None, spec)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"model": "/d", "num_speculative_tokens": 4}


def test_a_draft_models_kv_gets_its_share_of_the_native_cache(stored, tmp_path: Path) -> None:
    """Issue 13: the engine keeps the draft's K/V in the target's blocks; a cache sized for the target alone
    silently gave the target fewer tokens of context."""
    from runlm.runner.loader import Loader
    from runlm.runner.memory import MemoryBudget

    store, model = stored
    backends = all_backends(tmp_path)
    native = backends["native"]
    loader = Loader(store, backends, MemoryBudget(1 << 40))
    loader.configs[(model.id, "native")] = BackendConfig.from_json(
        {"context-size": 1024, "speculative": {"draft_model": "smollm2", "num_tokens": 3}})
    config = asyncio.run(loader._resolved_config(model, "native"))
    per_token = model.info.kv_bytes_per_token(2)  # fp16: a GGUF's on the native runner, the draft's too
    assert config.speculative.draft_kv_bytes_per_token == per_token  # the draft here is the model itself
    plain = BackendConfig(context_size=1024)
    assert kv_cache_bytes(model, 1024, config) == 2 * kv_cache_bytes(model, 1024, plain) == 2 * per_token * 1024 * 2
    grown = native.required_memory(model, config).ram - native.required_memory(model, plain).ram
    assert grown == draft_bytes(config) + per_token * 1024 * 2  # the draft's weights and its K/V
    argv = native.command("/s.sock", "/m.gguf", "m", model, config)
    assert int(argv[argv.index("--kv-cache-memory") + 1]) == kv_cache_bytes(model, 1024, config)


def test_a_kv_cache_runtime_flag_is_counted_by_the_budget(stored, tmp_path: Path) -> None:
    """Issue 15 #11: '--kv-cache-memory 8GiB' as a runtime flag made the process take 8 GiB the budget never saw."""
    store, model = stored
    native = all_backends(tmp_path)["native"]
    base = native.required_memory(model, BackendConfig()).ram
    default_kv = kv_cache_bytes(model, native.context_size(model, BackendConfig()))
    for flags, kv in ((["--kv-cache-memory", "8GiB"], 8 << 30), (["--kv-cache-memory=3GiB"], 3 << 30),
                      (["--kv-cache-memory", "1GiB", "--kv-cache-memory", "2GiB"], 2 << 30)):
        cfg = BackendConfig(runtime_flags=flags)
        assert native.required_memory(model, cfg).ram == base - default_kv + kv, flags
        argv = native.command("/s.sock", "/m.gguf", "m", model, cfg)
        assert argv[-1] == flags[-1].partition("=")[2] or argv[-1] == flags[-1]  # and the process gets that size
    half = native.required_memory(model, BackendConfig(runtime_flags=["--kv-cache-memory", "0.5"])).ram
    assert half > base - default_kv + (1 << 20)  # a fraction of free memory, counted as bytes


def test_native_backend_puts_a_model_on_the_gpu_where_there_is_one(tmp_path: Path) -> None:
    """--device auto by default; on a GPU the model reserves its --gpu-memory-utilization share of the device
    (the engine profiles a step and sizes its KV cache from it), on the CPU its RAM as before."""
    from runlm.runner.backends.native import on_gpu
    from runlm.runner.config import BackendConfig

    gib = 1 << 30
    assert on_gpu(BackendConfig(), gpu_total=80 * gib) == int(80 * gib * 0.9)
    assert on_gpu(BackendConfig(runtime_flags=["--gpu-memory-utilization", "0.5"]), gpu_total=80 * gib) == 40 * gib
    assert on_gpu(BackendConfig(runtime_flags=["--device", "cpu"]), gpu_total=80 * gib) is None
    native = all_backends(tmp_path)["native"]
    with pytest.raises(ConfigError):
        native.check_flags(["--gpu-memory-utilization", "1.5"])
    assert native.check_flags(["--device", "auto", "--enforce-eager"]) == ["--device", "auto", "--enforce-eager"]
    # images: how many per request, and the hosts whose image URLs a backend may fetch (one per flag)
    flags = ["--limit-mm-per-prompt", "image=4", "--allowed-media-domains", "*.example.com"]
    assert native.check_flags(flags) == flags
    for bad in (["--limit-mm-per-prompt", "video=1"], ["--allowed-media-domains", "a.com/../x"],
                ["--allowed-media-domains", "file:///etc"]):
        with pytest.raises(ConfigError):
            native.check_flags(bad)


def test_a_q8_0_kv_cache_runtime_flag_is_checked_counted_and_shown(stored, tmp_path: Path) -> None:
    """--kv-cache-dtype q8_0 (issue 30): an allowed native runtime flag with a checked value; the budget counts the
    8-bit cache's bytes (34 per 32 values instead of 128) and the runner's entry (`runlm ps`) names the dtype."""
    store, model = stored
    native = all_backends(tmp_path)["native"]
    plain, q8 = BackendConfig(context_size=1024), BackendConfig(context_size=1024,
                                                                runtime_flags=["--kv-cache-dtype", "q8_0"])
    assert native.check_flags(["--kv-cache-dtype", "q8_0"]) == ["--kv-cache-dtype", "q8_0"]
    assert native.check_flags(["--kv-cache-dtype", "fp8"]) == ["--kv-cache-dtype", "fp8"]  # (the GPU runner's)
    for bad in (["--kv-cache-dtype", "fp4"], ["--kv-cache-dtype", "q8_0;rm"]):
        with pytest.raises(ConfigError):
            native.check_flags(bad)
    assert kv_cache_bytes(model, 1024, q8) * 64 == kv_cache_bytes(model, 1024, plain) * 34  # against fp16
    assert native.required_memory(model, plain).ram - native.required_memory(model, q8).ram == \
        kv_cache_bytes(model, 1024, plain) - kv_cache_bytes(model, 1024, q8)
    argv = native.command("/s.sock", "/m.gguf", "m", model, q8)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "q8_0"
    assert int(argv[argv.index("--kv-cache-memory") + 1]) == kv_cache_bytes(model, 1024, q8)
    assert native.kv_cache_dtype(q8) == "q8_0" and native.kv_cache_dtype(plain) == "auto"
    assert all_backends(tmp_path)["llamacpp"].kv_cache_dtype(q8) is None
