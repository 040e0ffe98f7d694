"""Run the migration pages' snippets of one launcher (and the tests' variants of them), each in its own process,
in one launch.

usage: snippet_batch.py [ARGS...] MANIFEST.json   (as the script of `python`, `accelerate launch` or torchrun)

tests/test_migration_guide.py launches this once per launcher instead of once per snippet: each launched
process imports torch and Accelerate once (5 s of CPU on a small machine, most of a short snippet's run), then
forks one child per snippet, in the manifest's order. A child runs its snippet as `python snippet.py ARGS`
would: as __main__, in the snippet's folder, with the arguments the launcher gave this batch before the manifest
(torchrun and accelerate launch give none, torch.distributed.launch --local-rank=N), with its environment (the
manifest's: mostly its own MASTER_PORT, so the children of every rank form a group of their own), its output in
that folder, and it ends as a process does (atexit handlers, the exit check of tests/exit_check). The parent
writes the child's exit status beside them: exit_status_RANK, a negative number for a signal, "timeout" when it
ran past the manifest's limit.
"""

import gc
import importlib
import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

# What the snippets import that costs seconds; imported here once, before any fork, never used (no threads yet).
# Not torch._dynamo: it imports torch.distributed.nn, whose default arguments hold the process group when it is
# imported after one exists; a snippet must show that early import itself ("Ending a run cleanly"). The last three
# are what torch._dynamo (imported by DDP and Accelerate's prepare) spends most of its 2-3 s on without importing
# torch.distributed.nn (the assert below checks that), so the child's own import of torch._dynamo takes about 1 s.
PRELOADED = ["numpy", "torch", "torch.distributed", "torch.multiprocessing", "torch.nn.parallel", "torch.utils.data",
             "accelerate", "accelerate.utils", "safetensors.torch",
             "sympy", "torch.fx.experimental.symbolic_shapes", "torch.distributed.tensor"]


def run_snippet(entry: dict, rank: str, launcher_args: list) -> None:
    """In the child: become `python snippet.py LAUNCHER_ARGS` in the snippet's folder, and run it."""
    os.chdir(entry["folder"])
    for descriptor, name in ((1, "stdout"), (2, "stderr")):
        with open(f"{name}_{rank}.txt", "w") as file:
            os.dup2(file.fileno(), descriptor)
    os.environ.update(entry["env"])
    sys.path[:0] = entry["path"]  # the Horovod stand-in, for this snippet only
    sys.argv = [entry["snippet"], *launcher_args]
    runpy.run_path(entry["snippet"], run_name="__main__")


def wait_for(pid: int, timeout: float):
    """A forked child's exit code (negative: a signal), or None when it ran past `timeout` and was killed.
    (Also used by tests/sample_recorder.py --jobs.)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def main() -> int:
    *launcher_args, manifest = sys.argv[1:]
    entries = json.loads(Path(manifest).read_text())
    rank = os.environ.get("RANK", "0")
    for module in PRELOADED:
        importlib.import_module(module)
    gc.freeze()  # as tests/sample_recorder.py: no child walks the preloaded objects in its collections (1 s each)
    assert "torch.distributed.nn" not in sys.modules, "preloaded: a snippet would not start as a fresh process does"
    for entry in entries:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # No try/finally around this: the child's exception or SystemExit ends it as it would end a script.
            run_snippet(entry, rank, launcher_args)
            return 0
        status = wait_for(pid, entry["timeout"])
        Path(entry["folder"], f"exit_status_{rank}").write_text("timeout" if status is None else str(status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
