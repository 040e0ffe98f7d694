"""Which training samples each process fetched, for train_mnist.py and train_image_classifier.py, unchanged.

Run as the launched script: `accelerate launch tests/sample_recorder.py SCRIPT ARGS` with $SAMPLE_LOG set. Before
SCRIPT runs, its training dataset is wrapped so that every __getitem__ appends one line "EPOCH INDEX" to
$SAMPLE_LOG.rank{RANK} (from a DataLoader worker: $SAMPLE_LOG.rank{RANK}.worker{ID}), in fetch order, flushed
at once. EPOCH is the image dataset's own epoch (what TransformedImages seeds its augmentations with); the
MNIST TensorDataset has none, so it is -1 there. The evaluation datasets are left alone. When SCRIPT ends,
its exit status goes to $SAMPLE_LOG.rank{RANK}.exit. Stopped by SIGTERM (the launcher does that to the other processes
when one fails), a process prints its Python threads' stacks first.

With --mixup_alpha/--cutmix_alpha the mixed sample is what trains: its line is "EPOCH INDEX PARTNER KIND LAM
DIGEST" (utils/data/mixing.py: PARTNER -1 and KIND "-" when it is not mixed; DIGEST: a hash of its pixels and
target), and its two images' fetches from the dataset it wraps write no line of their own.

With --streaming each image the stream decodes for training writes "EPOCH KEY" (KEY: the CRC-32 of the image file,
what utils/data/streaming.py seeds its augmentations with): a decoded image may be one of the last few that no whole
batch took.

Fetched is trained here: a prepared DataLoaderShard fetches one batch ahead but within the epoch only, and
skip_first_batches skips indices, not fetched batches. (A loop that breaks out of an epoch early would have
fetched one batch more than it trained.)

Also `--model tests.sample_recorder:tiny_cnn`: a classifier small enough that a checkpoint costs nothing.

Several runs in one launch: `accelerate launch tests/sample_recorder.py --jobs JOBS.json` (jobs_file() writes it).
Each launched process imports torch, Accelerate and the data libraries once (8-10 s of CPU, most of a small run), then
forks one child per job, in the file's order, that runs `SCRIPT ARGS` as above with the job's $SAMPLE_LOG, its own
MASTER_PORT (the children of every rank form a group of their own) and its output in $SAMPLE_LOG.rank{RANK}.out: as
tests/snippet_batch.py does for the migration guide's snippets. A job waits for the one before it, so it may resume
from its checkpoints. The launch exits 0 when every job ended as expected (`"fails": true`: non-zero). A job's
`"env"`: variables set for its child only (torchrun's for ddp_mnist.py, tests/test_baselines.py); its `"unset_env"`:
prefixes of the environment variables its child runs without (an FSDP launch's ACCELERATE_USE_FSDP and FSDP_*: a DDP
job, tests/test_fsdp.py). job_outcome and finished_job read a finished job's exit statuses and outputs.
"""

import faulthandler
import gc
import hashlib
import importlib
import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]


class _Log:
    """One line-buffered file per process (the training process, and each DataLoader worker)."""

    files = {}

    @classmethod
    def write(cls, *fields) -> None:
        pid = os.getpid()
        if pid not in cls.files:
            info = torch.utils.data.get_worker_info()
            suffix = f".worker{info.id}" if info is not None else ""
            cls.files[pid] = open(f"{os.environ['SAMPLE_LOG']}.rank{os.environ.get('RANK', '0')}{suffix}", "a",
                                  buffering=1)
        cls.files[pid].write(" ".join(map(str, fields)) + "\n")


class RecordedTensorDataset(torch.utils.data.Dataset):
    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        _Log.write(-1, int(index))
        return self.dataset[index]


def _patch_datasets() -> None:
    import utils.data.image_dataset
    import utils.data.mixing
    import utils.data.mnist
    import utils.data.recipes
    import utils.data.streaming

    # train_mnist.py: the training split's tensors, recognised by identity, become a recorded dataset
    load_mnist, to_tensor_dataset = utils.data.mnist.load_mnist, utils.data.mnist.to_tensor_dataset
    train_images = []

    def recorded_load_mnist(*args, **kwargs):
        splits = load_mnist(*args, **kwargs)
        train_images.append(splits["train"][0])
        return splits

    def recorded_to_tensor_dataset(images, labels, *args, **kwargs):
        dataset = to_tensor_dataset(images, labels, *args, **kwargs)
        return RecordedTensorDataset(dataset) if any(images is t for t in train_images) else dataset

    utils.data.mnist.load_mnist, utils.data.mnist.to_tensor_dataset = recorded_load_mnist, recorded_to_tensor_dataset

    # train_image_classifier.py: the dataset built with train_transform()'s transform records its fetches
    train_transform, TransformedImages = utils.data.recipes.train_transform, utils.data.image_dataset.TransformedImages
    train_transforms = []

    def recorded_train_transform(*args, **kwargs):
        train_transforms.append(train_transform(*args, **kwargs))
        return train_transforms[-1]

    class RecordedTransformedImages(TransformedImages):
        mixed = False  # wrapped by RecordedMixedImages, which writes the lines

        def _sample(self, index, *args):  # under both __getitem__ and __getitems__ (a batch's rows in one query)
            if any(self.transform is t for t in train_transforms) and not self.mixed:
                _Log.write(self.epoch, int(index))  # the epoch its augmentations are seeded with
            return super()._sample(index, *args)

    utils.data.recipes.train_transform = recorded_train_transform
    utils.data.image_dataset.TransformedImages = RecordedTransformedImages

    # --mixup_alpha/--cutmix_alpha: the training dataset is wrapped; the wrapper records what it hands out
    class RecordedMixedImages(utils.data.mixing.MixedImages):
        def __init__(self, dataset, *args, **kwargs):
            super().__init__(dataset, *args, **kwargs)
            dataset.mixed = True

        def __getitem__(self, index):
            image, target = super().__getitem__(index)
            epoch, (partner, kind, _) = self.epoch, self.pairing(self.epoch, index)
            lam = self.lam_of(epoch, index, *image.shape[-2:])
            _Log.write(epoch, int(index), partner, kind or "-", repr(lam), digest_of(image, target))
            return image, target

    utils.data.mixing.MixedImages = RecordedMixedImages

    # --streaming: each decoded training image writes "EPOCH KEY", KEY the CRC-32 of its file that seeds its augmentations
    class RecordedStreamedImages(utils.data.streaming.StreamedImages):
        def transformed(self, data, *args):
            _Log.write(self.epoch, zlib.crc32(data))
            return super().transformed(data, *args)

    utils.data.streaming.StreamedImages = RecordedStreamedImages


def digest_of(image: torch.Tensor, target: torch.Tensor) -> str:
    """A mixed sample's DIGEST: a hash of its pixels and target."""
    return hashlib.sha256(image.numpy().tobytes() + target.numpy().tobytes()).hexdigest()[:16]


def tiny_cnn(num_classes: int) -> nn.Module:
    """`--model tests.sample_recorder:tiny_cnn`: one convolution, BatchNorm, a linear head."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, num_classes))


def run_script(argv) -> None:
    """SCRIPT ARGS as `python SCRIPT ARGS` would run them; its exit status into $SAMPLE_LOG.rank{RANK}.exit."""
    # A process that the launcher stops because another one failed (e.g. a collective that timed out waiting for this
    # one) first prints where each of its Python threads was: the test's output then names where a late process stood.
    # (--save_on_signal replaces this with its own handler.)
    faulthandler.register(signal.SIGTERM, chain=True)
    script, *script_args = argv
    sys.argv = [script, *script_args]
    status = 1  # an exception other than SystemExit
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit_:  # the scripts end with sys.exit(status)
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        raise
    finally:
        Path(f"{os.environ['SAMPLE_LOG']}.rank{os.environ.get('RANK', '0')}.exit").write_text(str(status))


# What the scripts import that costs seconds: imported once per launched process in --jobs mode, before any fork.
PRELOADED = ["torch.distributed.nn", "torch._dynamo", "accelerate", "accelerate.utils", "torchvision", "datasets",
             "evaluate", "safetensors.torch", "tqdm.auto"]
# Where it is installed, Accelerate's unwrap_model and get_state_dict import deepspeed (10 s of CPU): imported after a
# gloo group exists, it keeps that group's worker threads alive past destroy_process_group, which the exit check
# records (measured: the converted scripts' --save-model runs on 2 processes); imported before, it keeps none.
OPTIONAL_PRELOADED = ["deepspeed"]


def jobs_file(path, jobs) -> Path:
    """Write PATH for `--jobs PATH`; `jobs`: dicts of argv (SCRIPT ARGS), sample_log, timeout (s) and optionally fails
    (the job must exit non-zero: a refusal), env (variables set for that job only, as a launcher's) and unset_env
    (prefixes: the variables of the launch the job runs without). Each job gets a free port of its own (its
    MASTER_PORT)."""
    from helpers import free_consecutive_ports  # the test process's; not at the top: launched processes import this

    first_port = free_consecutive_ports(len(jobs))
    Path(path).write_text(json.dumps([{**job, "argv": list(map(str, job["argv"])), "sample_log": str(job["sample_log"]),
                                       "port": first_port + i} for i, job in enumerate(jobs)]))
    return Path(path)


def job_outcome(sample_log, num_processes: int) -> tuple:
    """What a finished run wrote beside SAMPLE_LOG, per rank: (exit statuses, None where a process wrote none: killed
    at its timeout; outputs, each process's stdout and stderr, "" where it wrote none), rank 0 first."""
    log = Path(sample_log)
    exits = [log.with_name(f"{log.name}.rank{rank}.exit") for rank in range(num_processes)]
    outputs = [log.with_name(f"{log.name}.rank{rank}.out") for rank in range(num_processes)]
    return ([int(path.read_text()) if path.exists() else None for path in exits],
            [path.read_text() if path.exists() else "" for path in outputs])


def finished_job(sample_log, num_processes: int = 1, fails: bool = False) -> subprocess.CompletedProcess:
    """The job of SAMPLE_LOG as a finished process, asserting that every rank ended (none killed at its timeout) with
    the same exit status, 0 unless it `fails`; its stderr holds every rank's output, rank 0 first."""
    statuses, outputs = job_outcome(sample_log, num_processes)
    output = "".join(outputs)
    assert None not in statuses and len(set(statuses)) == 1 and (statuses[0] != 0) == fails, (
        f"job {Path(sample_log).name} exited {statuses}\n{output[-6000:]}")
    return subprocess.CompletedProcess(str(sample_log), statuses[0], "", output)


def run_jobs(path) -> int:
    """--jobs PATH: each job in a child forked from this process (see the docstring above)."""
    from snippet_batch import wait_for  # beside this file; not at the top: tests.sample_recorder:tiny_cnn imports this
    jobs = json.loads(Path(path).read_text())
    rank = os.environ.get("RANK", "0")
    for module in PRELOADED:
        importlib.import_module(module)
    for module in OPTIONAL_PRELOADED:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    # Out of the garbage collector's way: else every forked child walks all of torch's and Accelerate's objects in its
    # full collections (at its exit at least), about 1 s of CPU each; what a child creates is collected as before.
    gc.freeze()
    as_expected = True
    for job in jobs:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            # No try/finally around this: the child's exception or SystemExit ends it as it would end a script.
            os.environ.update({**job.get("env", {}), "SAMPLE_LOG": job["sample_log"], "MASTER_PORT": str(job["port"]),
                               "TORCHELASTIC_USE_AGENT_STORE": "False"})  # rank 0's child serves its group's store
            for name in [name for name in os.environ if name.startswith(tuple(job.get("unset_env", ())))]:
                del os.environ[name]
            with open(f"{job['sample_log']}.rank{rank}.out", "w") as output:
                os.dup2(output.fileno(), 1)
                os.dup2(output.fileno(), 2)
            run_script(job["argv"])
            sys.exit(0)
        status = wait_for(pid, job["timeout"])  # None: killed at its timeout
        as_expected &= (status != 0) == job.get("fails", False)
    return 0 if as_expected else 1


def main(argv) -> int:
    sys.path.insert(0, str(REPO))  # the same `utils` package that SCRIPT imports
    _patch_datasets()
    if argv[0] == "--jobs":
        return run_jobs(argv[1])
    run_script(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
