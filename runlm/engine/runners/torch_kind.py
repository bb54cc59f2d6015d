"""The torch runner's kind (runlm.engine.runners.select): what runs every model the others do not, on any device
(exact numerics, bf16/fp16 compute, the families and formats the native runner does not build). Importing this
module does not import torch; loading a model does."""
from __future__ import annotations

from typing import TYPE_CHECKING

from runlm.engine.runners.threads import set_torch_threads
from runlm.engine.types.config import EngineConfig, kv_cache_blocks
from runlm.models.spec import ModelSpec

if TYPE_CHECKING:
    from runlm.engine.core.kv_groups import AnyBlockManager
    from runlm.engine.runners.torch_runner import ModelRunner
    from runlm.engine.structured.backend import StructuredOutputManager
    from runlm.models.load import LoadedModel


class TorchKind:
    name = "torch"
    torch_free = False
    kv_cache_dtypes = ("auto",)

    def applies(self, config: EngineConfig) -> bool:
        return True

    def why_not(self, spec: ModelSpec, config: EngineConfig) -> str | None:
        return None  # the last resort: what it cannot read, its loader says

    def load(self, spec: ModelSpec, config: EngineConfig) -> LoadedModel:
        from runlm.models.load import load_decoder

        return load_decoder(spec, dtype=config.dtype, device=config.device, exact_numerics=config.exact_numerics)

    def build(self, config: EngineConfig, loaded: LoadedModel, blocks: AnyBlockManager,
              structured: StructuredOutputManager) -> ModelRunner:
        from runlm.engine.runners.torch_runner import ModelRunner

        return ModelRunner(config, loaded, blocks, structured)

    def kv_cache_blocks(self, config: EngineConfig, loaded: LoadedModel, bytes_per_token: int,
                        max_model_len: int) -> int:
        return kv_cache_blocks(config, bytes_per_token, max_model_len)

    def set_threads(self, n: int, loaded: object) -> None:
        set_torch_threads(n)


TORCH = TorchKind()
