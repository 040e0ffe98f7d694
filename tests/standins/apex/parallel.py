"""Stand-in for `apex.parallel` (tests/standins/README.md): its DistributedDataParallel averages the gradients as
PyTorch's does (delay_allreduce only changed when apex sent them)."""

import torch


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    def __init__(self, module, delay_allreduce=False, **kwargs):
        super().__init__(module, **kwargs)


def convert_syncbn_model(module):
    return torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
