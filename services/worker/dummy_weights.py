"""Random weights of a model's shape, for benchmarks without a checkpoint (``--load-format dummy``).

Matrices get a small normal spread and norms 1, so activations stay finite
through any depth and every kernel does the work a real checkpoint would
make it do; the outputs mean nothing.
"""

from __future__ import annotations

import torch
from torch import nn

_STD = 0.02


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> nn.Module:
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            if param.device not in generators:
                generators[param.device] = torch.Generator(param.device).manual_seed(seed)
            param.normal_(0.0, _STD, generator=generators[param.device])
    return model
