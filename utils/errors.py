"""User-caused errors: one clear line, a non-zero exit, no traceback."""

import os
import sys


class UserError(Exception):
    """A problem the user can fix (bad flag, missing data, corrupt checkpoint, ...).

    The message names the problem and the fix; scripts print it as one line and exit 1.
    """


def first_line(error, limit: int = 200) -> str:
    """An exception's message cut to its first line (a library's may run to pages), or its type's name."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:limit]


def exit_with_error(error, status: int = 1) -> None:
    # Every rank prints: they all run the same code on the same inputs, and printing on
    # rank 0 only would lose the message when another rank fails first and the launcher
    # stops rank 0 before it gets there.
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
