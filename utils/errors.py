"""User-caused errors: one clear line, a non-zero exit, no traceback."""

import sys


class UserError(Exception):
    """A problem the user can fix (bad flag, missing data, corrupt checkpoint, ...).

    The message names the problem and the fix; scripts print it as one line and exit 1.
    """


def exit_with_error(error, status: int = 1) -> None:
    # Every rank prints: they all run the same code on the same inputs, and printing on
    # rank 0 only would lose the message when another rank fails first and the launcher
    # stops rank 0 before it gets there.
    message = " ".join(str(error).split())
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


def check_process_group(accelerator) -> None:
    """Fail when `accelerate launch` started N processes but each one trains alone.

    That happens on a machine without GPUs when the script does not pass `cpu=True`:
    accelerate's multi-GPU launcher does not forward a YAML's `use_cpu: true`.
    """
    import os

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise UserError(
            f"accelerate launch started {launched} processes but they did not form one group "
            f"(this one sees {accelerator.num_processes}); on a machine without GPUs add --cpu to the script's flags"
        )
