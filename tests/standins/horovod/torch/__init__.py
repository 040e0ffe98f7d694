"""Stand-in for `horovod.torch` over torch.distributed (tests/standins/README.md). Started by torchrun: its RANK,
LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE play horovodrun's HOROVOD_RANK etc.; run alone it is one worker."""

import contextlib
import os

import torch
import torch.distributed.nn  # noqa: F401  before any process group: docs/migration_guide.md, "Ending a run cleanly"
import torch.distributed as dist

Average, Sum, Adasum = "average", "sum", "adasum"


class Compression:
    """What travels over the network: fp16 casts the gradients for the allreduce and back."""

    none = None
    fp16 = torch.float16


def init():
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")


def size():
    return dist.get_world_size() if dist.is_initialized() else 1


def rank():
    return dist.get_rank() if dist.is_initialized() else 0


def local_rank():
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_size():
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def nccl_built():
    return False


def shutdown():
    if dist.is_initialized():
        dist.destroy_process_group()


def allreduce(tensor, name=None, op=Average):
    """A new tensor: the sum over workers, divided by their number for Average (Horovod's default)."""
    result = tensor.detach().clone()
    if size() > 1:
        dist.all_reduce(result)
    return result / size() if op == Average else result


def allgather(tensor, name=None):
    if size() == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(size())]
    dist.all_gather(parts, tensor.detach().contiguous())
    return torch.cat(parts)


def broadcast_parameters(params, root_rank):
    """In place, from root_rank: a state_dict or named_parameters()."""
    items = params.items() if hasattr(params, "items") else params
    for _, tensor in items:
        if size() > 1:
            dist.broadcast(tensor.data, src=root_rank)


def broadcast_optimizer_state(optimizer, root_rank):
    """The optimizer's tensors in place, from root_rank (a fresh SGD has none: nothing to send)."""
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and size() > 1:
                dist.broadcast(value, src=root_rank)


class _DistributedOptimizer:
    """The optimizer, whose step() first averages every gradient over the workers (Horovod starts those
    allreduces during backward; here they run at synchronize(), which step() calls unless skip_synchronize())."""

    def __init__(self, optimizer, named_parameters, compression, op, gradient_predivide_factor):
        if op == Adasum:
            raise NotImplementedError("the stand-in has no Adasum")  # the scripts' tests never pass --use-adasum
        self._optimizer, self._compression, self._predivide = optimizer, compression, gradient_predivide_factor
        self._parameters = [parameter for _, parameter in named_parameters]
        self._synchronized, self._skip = False, False

    def __getattr__(self, name):  # param_groups, state, state_dict, zero_grad, ...
        return getattr(self._optimizer, name)

    def synchronize(self):
        for parameter in self._parameters:
            if parameter.grad is not None and size() > 1:
                grad = parameter.grad if self._compression is None else parameter.grad.to(self._compression)
                grad = grad / self._predivide  # Horovod: divide before the sum, multiply back after
                dist.all_reduce(grad)
                parameter.grad.copy_(grad * self._predivide / size())
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        if not self._skip:
            self.synchronize()
        self._synchronized = False
        return self._optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        return self._optimizer.zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none, backward_passes_per_step=1,
                         op=Average, gradient_predivide_factor=1.0):
    return _DistributedOptimizer(optimizer, list(named_parameters or []), compression, op, gradient_predivide_factor)
