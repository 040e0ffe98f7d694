"""Two libraries import a large optional package at their own import, when it is installed, for a feature these
scripts never use: evaluate imports transformers' pipelines for its Evaluator classes, DeepSpeed imports mlflow for its
autotuner's logging. Each costs every process of every run about 1.8 s of CPU at start (measured: a 1-process MNIST
run's imports 10.8 s, these two 3.7 s of it). Imported here with that package hidden, each skips the feature as it
does where the package is not installed; the package itself imports as usual afterwards (--report_to mlflow)."""

import sys
from contextlib import contextmanager


@contextmanager
def hidden(package: str):
    """Inside, `import package` (and its submodules) raises ImportError: a None entry in sys.modules, as Python's
    import system documents it. Nothing changes for a package already imported."""
    if package in sys.modules:
        yield
        return
    sys.modules[package] = None
    try:
        yield
    finally:
        if sys.modules.get(package, 0) is None:
            del sys.modules[package]


def import_evaluate():
    """`import evaluate`, without transformers' pipelines (its Evaluator classes; the metrics do not need them).
    evaluate.evaluator, in this process, then says transformers is missing; transformers itself imports as before."""
    with hidden("transformers"):
        import evaluate
    return evaluate


def import_deepspeed():
    """`import deepspeed`, without mlflow (its autotuner, `deepspeed --autotuning`, logs to MLflow)."""
    with hidden("mlflow"):
        import deepspeed
    return deepspeed
