"""Loaded by every Python process the tests start (tests/conftest.py puts this folder on PYTHONPATH): at exit, a
process whose gloo worker threads are still alive writes a file saying so into $EXIT_CHECK_DIR (tests/helpers.run
gives it one and reads it). Such a thread can abort the exit ("terminate called without an active exception";
docs/migration_guide.md, "Ending a run cleanly"), one run in seven at worst, so a script that ends without releasing
its DDP model before end_training fails its test every time instead. Registered after the freeze below and before the
script's own handlers, this one runs after the script's (atexit runs them last in, first out)."""

import atexit
import os
import sys


def _record_gloo_threads_left():
    folder = os.environ.get("EXIT_CHECK_DIR")
    try:
        names = [open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: nothing to check
        return
    if folder and "pt_gloo_runloop" in names:
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "w") as file:
            file.write(f"{names.count('pt_gloo_runloop')} gloo worker threads alive at the exit of {sys.argv}\n")


# FREEZE_AT_EXIT=1 (tests/conftest.py sets it for every process the tests start; tests/stress_snippets.py does not, so
# that its count of aborts at exit sees the unchanged exit): after the check above, the interpreter's last garbage
# collections skip every object already there, about 0.8 s of CPU per process that imported torch (most of a
# one-process run's exit). Objects that only a collection frees (reference cycles) are then left to the exit, as the
# process's memory is; those freed by their reference count still are, module by module. Registered before the check,
# it runs after it.
if os.environ.get("FREEZE_AT_EXIT") == "1":
    import gc

    atexit.register(gc.freeze)
atexit.register(_record_gloo_threads_left)


def _starve_gloo_workers():
    """STARVE_GLOO=1 (tests/stress_snippets.py --starve_gloo): make the exit-time abort likely instead of rare.
    Every thread of the process on one CPU, gloo's worker threads at SCHED_IDLE, so that they run only when
    every other thread sleeps and finish their last work late, as on an overloaded machine."""
    import threading
    import time

    cpu = min(os.sched_getaffinity(0))
    seen = set()

    def poll():
        while True:
            for tid in os.listdir("/proc/self/task"):
                if tid in seen:
                    continue
                seen.add(tid)
                try:
                    os.sched_setaffinity(int(tid), {cpu})
                    if open(f"/proc/self/task/{tid}/comm").read().strip() == "pt_gloo_runloop":
                        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                except OSError:  # the thread has ended
                    pass
            time.sleep(0.005)

    threading.Thread(target=poll, name="starve_gloo", daemon=True).start()


if os.environ.get("STARVE_GLOO") == "1" and os.path.isdir("/proc/self/task"):
    _starve_gloo_workers()


# PROCESS_LOG=FILE (suite-time work): one line per Python process started, to count what a test file launches
# independently of how loaded the machine is (docs/testing.md, "Where the suite's time goes").
if os.environ.get("PROCESS_LOG"):
    with open(os.environ["PROCESS_LOG"], "a") as _log:
        _log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0]}\t{' '.join(sys.argv)[:300]}\n")
