"""User-caused errors: one clear line, a non-zero exit, no traceback."""

import contextlib
import os
import signal
import sys
import time

# How long a machine's other processes leave its first process to say an error line they all reached (below)
OTHERS_WAIT_S = 3


class UserError(Exception):
    """A problem the user can fix (bad flag, missing data, corrupt checkpoint, ...).

    The message names the problem and the fix; scripts print it as one line and exit 1.
    """


def first_line(error, limit: int = 200) -> str:
    """An exception's message cut to its first line (a library's may run to pages), or its type's name."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def exit_with_error(error, status: int = 1) -> None:
    # Said once per machine, by its first process (LOCAL_RANK 0): the processes run the same code on the same inputs,
    # so a refusal reaches all of them. The others wait a moment first, in which the launcher, once the first process
    # has failed, ends them (SIGTERM, whatever handler --save_on_signal set). One that fails alone (its own shard, a
    # full disk) is not ended so, and says its line after the wait: no line is lost to a launcher that stopped the
    # first process before it got there.
    if int(os.environ.get("LOCAL_RANK", "0")) > 0:
        with contextlib.suppress(ValueError):  # signal.signal works in the main thread only
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(OTHERS_WAIT_S)
    text = str(error)
    if "Original Traceback" in text:  # raised in a DataLoader worker, which wraps it in the worker's traceback
        text = text.rstrip().splitlines()[-1].split("UserError: ", 1)[-1]
    message = " ".join(text.split())
    # A progress bar (ours, still open, or another rank's under a launcher) may have left the line
    # unfinished: start on a fresh one. One write() keeps the line whole even when stderr is
    # unbuffered (PYTHONUNBUFFERED), where print() would write text and newline apart.
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    bar_open = tqdm is not None and len(getattr(tqdm, "_instances", ())) > 0
    fresh_line = "\n" if int(os.environ.get("WORLD_SIZE", "1")) > 1 or bar_open else ""
    sys.stderr.write(f"{fresh_line}error: {message}\n")
    sys.stderr.flush()
    sys.exit(status)
