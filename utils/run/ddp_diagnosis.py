"""DDP's unused-parameter error: recognise it and name the parameters that caused it."""

import contextlib
import copy

import torch
from torch import nn

from ..errors import UserError


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


@contextlib.contextmanager
def unused_parameters_named(accelerator, model: nn.Module, inputs: torch.Tensor):
    """Around the forward pass of the prepared (DDP) `model`: DDP reports parameters that got no gradient one step
    after the fact and without their names; this turns its error into one line that names them (found on a copy
    of the plain module, without DDP or torch.compile wrappers) and the flag that allows them."""
    try:
        yield
    except RuntimeError as err:
        if not is_unused_parameter_error(err):
            raise
        unused = parameters_without_gradient(accelerator.unwrap_model(model, keep_torch_compile=False), inputs)
        raise UserError(f"DDP stopped: the loss does not depend on these parameters: "
                        f"{', '.join(unused) or '(none found in one pass)'}; "
                        f"pass --find_unused_parameters (slower), or remove them from the model") from None
