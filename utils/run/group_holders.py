"""Imports that must come before the process group exists, because the module would otherwise keep the group alive."""


def import_deepspeed_if_installed() -> None:
    """With DeepSpeed installed, import it now, before the Accelerator creates the process group.

    deepspeed.comm.torch's TorchBackend.barrier and monitored_barrier take `group=GroupMember.WORLD` as a default
    argument, evaluated once, at import. Accelerate imports DeepSpeed whenever it is installed, DeepSpeed run or not,
    the first time it unwraps a model (utils.other.extract_model_from_parallel: unwrap_model, save_model): after the
    group exists, so those defaults then hold it for good, end_training can no longer free it, and its gloo worker
    threads outlive the run (one alive at exit can abort it: docs/ending_a_run_cleanly.md). Imported before the
    group, the defaults hold None. A DeepSpeed run imports it there anyway; other runs pay the import a few seconds
    earlier, or, if they never unwrap a model, in addition."""
    from accelerate.utils import is_deepspeed_available

    from ..lean_imports import import_deepspeed

    if is_deepspeed_available():
        import_deepspeed()
