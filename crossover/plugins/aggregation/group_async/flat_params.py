"""A model's parameters as one flat fp32 vector, and back: what an exchange with the parameter service carries."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

__all__ = ["Model", "flatten", "load_flat", "parts"]

Model = Union[torch.Tensor, Sequence[torch.Tensor]]
"""What a leader exchanges: its parameters (any shapes, dtypes, devices), or one flat float32 tensor."""


def parts(model: Model) -> list[torch.Tensor]:
    """The model as its list of tensors."""
    return [model] if isinstance(model, torch.Tensor) else list(model)


def flatten(model: Model) -> torch.Tensor:
    """The model's parameters as one contiguous fp32 vector on the CPU: what an exchange carries."""
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in parts(model)])


def load_flat(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a flat vector (as `flatten` made it) back into the parameters, in place, each in its dtype."""
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset:offset + n].view_as(p).to(p.dtype))
            offset += n
