"""Stand-in for `apex.amp` (tests/standins/README.md): O0 (fp32 throughout, which the CPU tests use) with a static
loss scale; the other opt levels need CUDA and apex's patched functions, so they are refused."""

import contextlib

_loss_scale = 1.0


def initialize(model, optimizer, opt_level="O0", keep_batchnorm_fp32=None, loss_scale=None):
    global _loss_scale
    if opt_level not in (None, "O0"):
        raise NotImplementedError(f"the stand-in runs O0 only, not {opt_level}")
    _loss_scale = 1.0 if loss_scale in (None, "dynamic") else float(loss_scale)
    return model, optimizer


@contextlib.contextmanager
def scale_loss(loss, optimizer):
    """Yields the scaled loss; after its backward, the gradients are unscaled in place."""
    yield loss * _loss_scale
    if _loss_scale != 1.0:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    parameter.grad.div_(_loss_scale)


def state_dict():
    return {"loss_scaler0": {"loss_scale": _loss_scale, "unskipped": 0}}


def load_state_dict(state):
    global _loss_scale
    _loss_scale = state["loss_scaler0"]["loss_scale"]
