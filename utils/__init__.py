"""Plumbing shared by the scripts: flags, data, models, metrics, checkpoints, results, launch checks.

The scripts decide how processes talk to each other; the helpers here only say what they do.
Two of them take the Accelerator and are collective (every process must call them, at the same
point): `checkpoints.save_checkpoint` (barriers, then `save_state`; the main process renames the
folder into place) and `results.report_run` (gathers one row per process). Everything else is local
to the process that calls it. The scripts put the repository root on sys.path, so `utils` works
from a plain clone.
"""
