"""A process that stops answering (a hung GPU, a frozen node, a rank on another code path) leaves
the others waiting in a collective until the process group's timeout (--ddp_timeout). Then the
backend raises; this turns that into one line that says what happened and where."""

import contextlib

from utils.errors import UserError

# What the backends say when a collective waited too long (torch 2.x): gloo raises a RuntimeError
# "Timed out waiting Nms for recv/send operation to complete", the store "wait timeout after Nms",
# NCCL's watchdog "Watchdog caught collective operation timeout" (a DistBackendError).
TIMEOUT_MESSAGES = ("Timed out waiting", "wait timeout after", "collective operation timeout",
                    "Connection closed by peer")


def is_collective_timeout(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(text in str(err) for text in TIMEOUT_MESSAGES)


@contextlib.contextmanager
def collective_timeouts_named(args, progress):
    """Around the training loop: a collective that timed out ends the run with one `error:` line
    naming the timeout and the optimizer step (every other error passes through unchanged)."""
    try:
        yield
    except RuntimeError as err:
        if not is_collective_timeout(err):
            raise
        raise UserError(
            f"a collective operation timed out after --ddp_timeout {args.ddp_timeout} s during optimizer step "
            f"{progress.global_step + 1}: another process stopped answering (a hung GPU, a frozen node, or a "
            f"process on another code path); look at the other processes' output, and raise --ddp_timeout if "
            f"steps are legitimately that slow (a long checkpoint save)"
        ) from None
