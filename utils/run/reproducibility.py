"""--deterministic: the settings that make GPU runs repeatable, bit for bit, where PyTorch can.

On the CPU our runs are deterministic already (the tests compare weights bit for bit). On CUDA two
things vary between runs: cuDNN's autotuner may pick different convolution algorithms, and some
kernels accumulate with atomic adds in whatever order the threads arrive. Both are switched off
here, at some cost in speed, except in the few kernels that have no deterministic version (e.g.
the backward pass of adaptive average pooling, in every torchvision ResNet): PyTorch warns once
for each of those and the run goes on, so such a run is not bit for bit repeatable.
"""

import os
import warnings

import torch


def make_deterministic(enabled: bool = True) -> None:
    """--deterministic (`enabled`; False: nothing changes). Call before the first CUDA operation (cuBLAS reads its
    workspace setting once)."""
    if not enabled:
        return
    # cuBLAS: a fixed workspace makes its reductions repeatable (PyTorch's reproducibility notes).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False  # the autotuner times algorithms and may pick another next run
    torch.backends.cudnn.deterministic = True
    # warn_only: a few backward kernels (e.g. adaptive average pooling on CUDA) have no deterministic
    # version; PyTorch names them in a warning instead of stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)
    warnings.filterwarnings("once", message=".*does not have a deterministic implementation.*")
