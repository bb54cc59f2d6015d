"""What an adapter module must be to attach to a model's module: shared by the torch model's attach
(runlm.models.lora) and the native decoder's (runlm.models.native_lora). Torch-free."""
from __future__ import annotations

from runlm.formats import LoRAError


def check_module(source: str, name: str, rank: int, shape: tuple[int, int], model_shape: tuple[int, int] | None,
                 max_rank: int | None) -> None:
    """Raise LoRAError unless module ``name`` (A/B mapping ``shape`` = (in, out) features, of ``rank``) fits the
    model's module (``model_shape`` = (in, out) features; None where the model has no such module)."""
    if model_shape is None:
        raise LoRAError(f"{source}: target module {name!r} cannot be adapted (runlm applies LoRA "
                        f"to q/k/v/o_proj, gate/up/down_proj and qkv_proj/gate_up_proj of decoder layers)")
    if max_rank is not None and rank > max_rank:
        raise LoRAError(f"{source}: module {name!r} has rank {rank}, above max_lora_rank {max_rank}")
    if shape != model_shape:
        raise LoRAError(f"{source}: module {name!r} maps {shape[0]} -> {shape[1]} features, "
                        f"but the model's maps {model_shape[0]} -> {model_shape[1]}")
