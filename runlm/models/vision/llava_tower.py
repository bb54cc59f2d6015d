"""LLaVA's tower and projector (torch): runlm.models.vision.llava configures them and builds the processor."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from runlm.formats import ModelFormatError
from runlm.models.vision.inputs import ImageFeature
from runlm.models.vision.vit import VisionTransformer, ViTConfig

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "relu": F.relu,
}


class _Projector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ModelFormatError(f"projector_hidden_act {act!r} is not supported")
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    uses_mrope = False

    def __init__(self, vision_config: dict, clip: bool, feature_layer: int, drop_first: bool, text_hidden: int,
                 act: str, bias: bool, processor: Any) -> None:
        """``feature_layer``: the index into hidden_states (0: the embeddings, i: after i layers) the projector
        reads; ``drop_first``: without the first token (the "default" strategy: CLIP's class token)."""
        super().__init__()
        c = ViTConfig.from_hf(vision_config, clip=clip)
        self.clip, self.drop_first = clip, drop_first
        self.vision_tower = VisionTransformer(c, feature_layer=feature_layer)
        self.multi_modal_projector = _Projector(c.hidden_size, text_hidden, act, bias)
        self.processor = processor

    def encode(self, features: Sequence[ImageFeature]) -> list[torch.Tensor]:
        if not features:
            return []
        w = self.multi_modal_projector.linear_1.weight
        pixels = torch.from_numpy(np.stack([f.data["pixel_values"] for f in features])).to(w.device)
        with torch.no_grad():
            x = self.vision_tower(pixels)
            if self.drop_first:
                x = x[:, 1:]
            y = self.multi_modal_projector(x).float()
        return list(y.unbind(0))

    @torch.no_grad()
    def load_hf(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        tower: list[tuple[str, torch.Tensor]] = []
        projector: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            base = name.removeprefix("model.")
            if base.startswith("vision_tower."):
                # the hub's vision_tower.vision_model.*; transformers 5 saves CLIP's and SigLIP's without vision_model
                tower.append((base[len("vision_tower."):].removeprefix("vision_model."), tensor))
            elif base.startswith("multi_modal_projector."):
                projector[base[len("multi_modal_projector."):]] = tensor
            else:
                raise ModelFormatError(f"unexpected weight {name!r} in a LLaVA checkpoint")
        try:
            self.vision_tower.load_hf(tower)
        except (KeyError, RuntimeError) as exc:
            raise ModelFormatError(f"LLaVA vision tower: {exc}") from None
        params = dict(self.multi_modal_projector.named_parameters())
        if set(projector) != set(params):
            raise ModelFormatError(f"LLaVA projector: the checkpoint has {sorted(projector)}, expected "
                                   f"{sorted(params)}")
        for key, tensor in projector.items():
            if tuple(tensor.shape) != tuple(params[key].shape):
                raise ModelFormatError(f"LLaVA projector {key}: shape {tuple(tensor.shape)}, expected "
                                       f"{tuple(params[key].shape)}")
            params[key].copy_(tensor.float())
