"""`evaluate` metrics: the local modules in this folder by name, anything else from the Hub."""

from pathlib import Path

LOCAL_METRICS = Path(__file__).resolve().parent


def load_metric(name: str = "accuracy"):
    """`load_metric("accuracy")` loads ./accuracy.py by path and works offline; a name with no
    local module (e.g. "f1") goes to `evaluate.load` and needs the Hub."""
    from ..lean_imports import import_evaluate

    evaluate = import_evaluate()  # here, not at the top: it imports datasets, seconds that --help need not wait

    local_module = LOCAL_METRICS / f"{name}.py"
    # keep_in_memory: every process computes on the gathered predictions; no shared cache files.
    return evaluate.load(str(local_module) if local_module.is_file() else name, keep_in_memory=True)
