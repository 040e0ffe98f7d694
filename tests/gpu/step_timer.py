"""When each optimizer step ended and how long the training loop waited for its batches, for a script run unchanged.

Run as the launched script: `accelerate launch tests/gpu/step_timer.py SCRIPT ARGS` with $STEP_TIMER_OUT set. Before
SCRIPT runs, two hooks go in: a global optimizer-step post-hook stamps the wall time after each step (torch's own
hook, so every optimizer of any script counts), and the DataLoader iterator's __next__ adds up the time the main
process spent blocked in it, which is waiting for the workers' next batch. When SCRIPT ends, $STEP_TIMER_OUT gets
{"step_ends": [t, ...], "wait_s": [w, ...]}: wait_s[i] is the time waited between step i-1's end and step i's end.
The GPU check (tests/gpu/check.py) turns these into images/s, the data-wait share of each step, and the window over
which it averages the GPU's utilisation. A script without a DataLoader (--data_on_device) waits 0 by construction.
"""

import json
import os
import runpy
import sys
import time
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data.dataloader import _BaseDataLoaderIter

REPO = Path(__file__).resolve().parents[2]


class _Steps:
    ends, waits, waited = [], [], 0.0


def _after_optimizer_step(optimizer, args, kwargs):
    _Steps.ends.append(time.time())
    _Steps.waits.append(_Steps.waited)
    _Steps.waited = 0.0


def _install_hooks():
    register_optimizer_step_post_hook(_after_optimizer_step)
    next_batch = _BaseDataLoaderIter.__next__

    def timed_next(self):
        started = time.perf_counter()
        try:
            return next_batch(self)
        finally:
            _Steps.waited += time.perf_counter() - started

    _BaseDataLoaderIter.__next__ = timed_next  # the only __next__: the worker and single-process iterators share it


def main(argv) -> None:
    sys.path.insert(0, str(REPO))  # the same `utils` package that SCRIPT imports
    script, *script_args = argv
    sys.argv = [script, *script_args]
    _install_hooks()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if os.environ.get("RANK", "0") == "0":
            timing = {"step_ends": _Steps.ends, "wait_s": _Steps.waits}
            Path(os.environ["STEP_TIMER_OUT"]).write_text(json.dumps(timing))


if __name__ == "__main__":
    main(sys.argv[1:])
