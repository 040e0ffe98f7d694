"""The foreign project's own `utils` module (pytorch/examples' distributed/FSDP2 has a utils.py like it beside its
example.py): tests/test_helpers_shadowing.py checks that importing our helpers leaves it importable."""

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor


def inspect_model(model) -> int:
    """The parameter elements this process holds; the model must be sharded by FSDP2."""
    assert isinstance(model, FSDPModule), type(model)
    assert all(isinstance(parameter, DTensor) for parameter in model.parameters())
    return sum(parameter.to_local().numel() for parameter in model.parameters())


def whole_elements(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())
