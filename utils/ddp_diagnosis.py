"""DDP's unused-parameter error: recognise it and name the parameters that caused it."""

import copy

import torch
from torch import nn


def is_unused_parameter_error(err: BaseException) -> bool:
    """DDP's "Expected to have finished reduction in the prior iteration ..." RuntimeError."""
    return isinstance(err, RuntimeError) and "not used in producing loss" in str(err)


def parameters_without_gradient(model: nn.Module, inputs: torch.Tensor) -> list:
    """Names of the trainable parameters that get no gradient from one forward/backward.

    The single-process debugging recipe, on a copy: the model inside DDP keeps its hooks
    and its state untouched.
    """
    probe = copy.deepcopy(model).train()
    for parameter in probe.parameters():
        parameter.grad = None
    with torch.enable_grad():
        outputs = probe(inputs)
        outputs = outputs if isinstance(outputs, torch.Tensor) else outputs[0]
        outputs.float().sum().backward()
    return [name for name, p in probe.named_parameters() if p.requires_grad and p.grad is None]
