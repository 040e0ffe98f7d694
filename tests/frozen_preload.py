"""Launch tests/snippet_batch.py or tests/sample_recorder.py with what they preload kept out of the garbage
collector's way in the children they fork:

    frozen_preload.py tests/snippet_batch.py ARGS...    (or tests/sample_recorder.py --jobs JOBS.json)

imports the script's PRELOADED modules, calls gc.freeze(), then runs the script with ARGS as python would. A child
forked from a launched process that holds torch and Accelerate otherwise walks every one of their objects in its
full collections, at its exit at least: about 1 s of CPU per child here, as much as a small snippet's own work.
Frozen (https://docs.python.org/3/library/gc.html#gc.freeze), those objects are never visited again; what a child
creates is collected as before. Used by tests/test_migration_guide.py and tests/test_whole_script_conversion.py.
"""

import gc
import importlib
import runpy
import sys
from pathlib import Path


def main() -> None:
    script, *args = sys.argv[1:]
    for name in importlib.import_module(Path(script).stem).PRELOADED:  # the script sits beside this file
        importlib.import_module(name)
    gc.freeze()
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
