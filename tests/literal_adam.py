"""The literal conversion of a DeepSpeed config's "type": "Adam": run a converted script (SCRIPT ARGS) with
torch.optim.Adam wherever it builds torch.optim.AdamW, Adam's `weight_decay` then an L2 term added to the gradient
where DeepSpeed's "Adam" (adam_w_mode true by default) decays the weights apart from it.
tests/test_whole_script_conversion.py runs scripts/converted_deepspeed_style.py so, as a job of its one-process
launch, and measures how far its losses drift from the DeepSpeed before's.

usage: literal_adam.py SCRIPT ARGS
"""

import runpy
import sys

import torch

if __name__ == "__main__":
    torch.optim.AdamW = torch.optim.Adam
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
