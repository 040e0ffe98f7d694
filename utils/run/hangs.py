"""A process that stops answering (a hung GPU, a frozen node, a rank on another code path) leaves
the others waiting in a collective until the process group's timeout (--ddp_timeout). Then gloo (and
NCCL with TORCH_NCCL_BLOCKING_WAIT=1) raises; this turns that into one line that says what happened and
where. NCCL's watchdog otherwise ends the process itself, with its own message. A collective whose
other end ended (a process that failed or was killed) stops this process with a note instead, so that
the failed process's own error stays the one `error:` line."""

import contextlib
import os
import sys

from ..errors import UserError

# What the backends raise (a RuntimeError, or its subclass DistBackendError) when a collective waited
# too long, in torch 2.x: gloo "Timed out waiting 5000ms for recv operation to complete", the store
# "wait timeout after 5000ms", NCCL with TORCH_NCCL_BLOCKING_WAIT=1 "... timed out in blocking wait". NCCL's
# watchdog ("Watchdog caught collective operation timeout") raises nothing in Python by default: under torchrun
# (TORCH_NCCL_ASYNC_ERROR_HANDLING=1) it takes the process down itself. A gloo recv that timed out also closes
# every connection of its group, so the group's other operations, under way or next (DDP's bucketed
# all-reduce, the next forward's buffer broadcast), may raise "Application timeout caused pair closure"
# first. tests/test_hangs.py checks gloo's.
TIMEOUT_MESSAGES = ("Timed out waiting", "wait timeout after", "collective operation timeout",
                    "timed out in blocking wait", "Application timeout caused pair closure")
# What gloo raises when the process at the other end ended mid-collective (a crash, the OOM killer,
# the launcher stopping the job after another process failed): no timeout, and its own output says why.
PEER_GONE_MESSAGES = ("Connection closed by peer", "Connection reset by peer")


def collective_failure(err: BaseException):
    """The kind of failed collective behind an exception: "timeout", "peer gone", or None for anything else."""
    if not isinstance(err, RuntimeError):
        return None
    text = str(err)
    if any(message in text for message in TIMEOUT_MESSAGES):
        return "timeout"
    if any(message in text for message in PEER_GONE_MESSAGES):
        return "peer gone"
    return None


@contextlib.contextmanager
def collective_timeouts_named(ddp_timeout, progress=None):
    """Around the training loop (with `progress`), and around the whole run (without: start-up, loading a checkpoint,
    the final evaluation and save), with --ddp_timeout `ddp_timeout`: a collective that timed out ends the run with one
    `error:` line naming the timeout and the optimizer step or the phase; one that lost the process at its other end
    ends this process quietly, with a note (other errors pass through unchanged)."""
    try:
        yield
    except RuntimeError as err:
        failure = collective_failure(err)
        steps = (f"with {progress.global_step} optimizer steps done" if progress is not None else
                 "outside the training loop (starting, loading a checkpoint, evaluating or saving)")
        if failure == "timeout":
            raise UserError(
                f"a collective operation timed out after --ddp_timeout {ddp_timeout} s, {steps}: another "
                f"process stopped answering (a hung GPU, a frozen node, or a process on another code path); "
                f"look at the other processes' output, and raise --ddp_timeout if steps are legitimately that "
                f"slow (a long checkpoint save)"
            ) from None
        if failure == "peer gone":
            # Not an `error:` line: the cause is the other process's, and its own line (or the launcher's report
            # of its exit, e.g. SIGKILL from the OOM killer) says it; a second `error:` line would only hide it.
            sys.stderr.write(f"\n[rank {os.environ.get('RANK', '?')}] stopping: another process ended during a "
                             f"collective operation, {steps}; its output or the launcher's report says why\n")
            raise SystemExit(1) from None
        raise
