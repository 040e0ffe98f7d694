"""Plumbing shared by the training scripts: flags, data, models, metrics, checkpoints, results.

Nothing in here decides how processes talk to each other; that stays visible in scripts/.
The scripts put the repository root on sys.path, so `utils` works from a plain clone.
"""
