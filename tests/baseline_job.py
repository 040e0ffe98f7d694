"""Run a "before" script of tests/test_whole_script_conversion.py as one job of tests/jobs.py, the
way its own launcher would start it:

    baseline_job.py [--standins] [--local-rank] SCRIPT ARGS

--standins: tests/standins first on sys.path, for this job only (Horovod's and apex's stand-ins: the converted
scripts forked from the same process must fail to import them as they would anywhere). --local-rank: SCRIPT
--local-rank=$LOCAL_RANK ARGS, the flag torch.distributed.launch adds in each process (torchrun, which accelerate
launch runs, gives only the environment). Then SCRIPT runs as `python SCRIPT ARGS` would, as __main__.
"""

import os
import runpy
import sys
from pathlib import Path

STANDINS = Path(__file__).resolve().parent / "standins"


def main(argv) -> None:
    flags = []
    while argv[0] in ("--standins", "--local-rank"):
        flags.append(argv.pop(0))
    script, *args = argv
    if "--standins" in flags:
        sys.path.insert(0, str(STANDINS))
    if "--local-rank" in flags:
        args.insert(0, f"--local-rank={os.environ['LOCAL_RANK']}")
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
