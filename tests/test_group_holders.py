"""utils/run/group_holders.py: with DeepSpeed installed, a run that unwraps its model (save_model does) still ends
with no gloo worker thread alive, provided the scripts import DeepSpeed before the process group exists."""

import importlib.util
import sys

import pytest
from helpers import REPO, free_port, run

# One process in a one-process gloo group, as the scripts do it: torch.distributed.nn and DeepSpeed imported before
# the Accelerator creates the group; unwrap_model makes Accelerate import DeepSpeed (utils.other.
# extract_model_from_parallel); released and ended as the scripts end. helpers.run's exit check then fails the run
# if a gloo worker thread is still alive, which it is if DeepSpeed's import comes after the group.
A_RUN_THAT_UNWRAPS = """
import os, sys
import torch
import torch.distributed.nn
from accelerate import Accelerator
from utils.run.group_holders import import_deepspeed_if_installed

import_deepspeed_if_installed()
accelerator = Accelerator(cpu=True)
assert accelerator.num_processes == 1 and torch.distributed.is_initialized()
model = accelerator.prepare(torch.nn.Linear(2, 1))
accelerator.unwrap_model(model)
assert "deepspeed" in sys.modules
model = accelerator.free_memory(model)
accelerator.end_training()
"""


def test_a_run_that_unwraps_its_model_leaves_no_gloo_thread_with_deepspeed_installed():
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed is not installed: Accelerate never imports it, so nothing holds the group")
    env = {"PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    run([sys.executable, "-c", A_RUN_THAT_UNWRAPS], env=env, timeout=300)
