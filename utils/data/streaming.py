"""--streaming: training images read as a `datasets` IterableDataset (a Hub dataset with streaming=True, or local files:
an image folder, parquet files, webdataset tar shards), never all in memory or in a cache.

What an epoch of a stream is: one pass over this process's part of the stream (split_dataset_by_node below), shuffled
with a buffer seeded by (--seed, epoch), that ends for every process at the same optimizer step: the first at which
some process has no whole accumulation cycle of whole batches left (batches_every_process_has). Each sample is trained
at most once per epoch; the samples left over at an epoch's end (at most one accumulation cycle's worth on the process
that ran out first, more on the others when the parts differ in size) are not trained in that epoch. A run lasts
--max_steps optimizer steps, over as many epochs as that takes. Evaluation reads the evaluation split in full, as a
map-style dataset (it must be small enough for memory): exact, as without --streaming.
"""

import zlib
from pathlib import Path

import torch

from ..data.data_layout import check_every_row_has_an_image, check_image_folder, mixed_extensions_error
from ..data.image_dataset import decode_and_transform, image_bytes
from ..data.image_loading import EVAL_SPLITS, column_of_type
from ..data.labels import class_names_of, encode_labels, sorted_label_values
from ..errors import UserError, first_line

# Examples held in the shuffle buffer of each DataLoader worker: a shuffle across shards (their order is shuffled per
# epoch too) and within this window. Bigger mixes better and costs memory (encoded images: ~100 KB each for photos).
SHUFFLE_BUFFER_SIZE = 1000


def load_image_stream(data_dir=None, dataset=None, dataset_config=None, image_column=None, label_column=None):
    """(train stream, eval split, image_column, label_column, class_names, label_ids): the training split as a
    `datasets.IterableDataset`, the evaluation split (validation or test) read once into a map-style `datasets.Dataset`.
    label_ids maps the stream's label values to class ids where its label column is no ClassLabel (webdataset's "cls"):
    ids of the sorted distinct values of the evaluation split (numbers in numeric order); None where the ClassLabel
    gives them."""
    import datasets

    source = f"--data_dir {data_dir}" if data_dir is not None else f"--dataset {dataset}"
    if data_dir is not None and Path(data_dir).is_dir():  # stray images, empty class folders, untrained classes
        check_image_folder(Path(data_dir))
    try:
        if data_dir is not None:
            splits = datasets.load_dataset("imagefolder", data_dir=str(data_dir), streaming=True)
        else:  # a Hub name, or a local folder of parquet files or webdataset tar shards
            splits = datasets.load_dataset(dataset, dataset_config, streaming=True)
    except Exception as err:  # no such folder, no data files, offline, unknown name: datasets raises many types
        raise UserError(mixed_extensions_error(source, err) or
                        f"could not stream {source} ({type(err).__name__}: {first_line(err)}); point it at an image "
                        f"folder, a folder of parquet or webdataset .tar files, or a Hub dataset") from None
    eval_name = next((name for name in EVAL_SPLITS if name in splits), None)
    if "train" not in splits or eval_name is None:
        raise UserError(f"{source} has the splits {sorted(splits)}; --streaming needs 'train' and 'validation' or "
                        f"'test' (DIR/train/ and DIR/val/; train-*.parquet and test-*.parquet): a stream cannot be "
                        f"split by --val_split")
    train = splits["train"]
    image_column = image_column or column_of_type(train, datasets.Image, "image", source, "--image_column")
    label_column = label_column or column_of_type(train, datasets.ClassLabel, "label", source, "--label_column")
    for column, flag in ((image_column, "--image_column"), (label_column, "--label_column")):
        if column not in (train.column_names or []):
            raise UserError(f"{source}: no column {column!r} (columns: {train.column_names}); fix {flag}")
    # the evaluation split in memory, undecoded (paths or the files' bytes): exact evaluation as with map-style data
    eval_stream = splits[eval_name].select_columns([image_column, label_column])
    eval_stream = eval_stream.cast_column(image_column, datasets.Image(decode=False))
    eval_split = datasets.Dataset.from_list(list(eval_stream), features=eval_stream.features)
    check_every_row_has_an_image(eval_split, image_column, f"{source}: the evaluation split")
    label_ids = None
    if isinstance(train.features[label_column], datasets.ClassLabel):
        class_names = train.features[label_column].names
    else:  # plain integer or string labels: one class per distinct value of the evaluation split (a stream cannot be
        # read ahead), sorted as without --streaming (integers as numbers: utils/data/labels.py)
        values = sorted_label_values(eval_split.unique(label_column), source)
        eval_split = encode_labels(eval_split, label_column, values, source, eval_name)
        class_names = class_names_of(values)
        label_ids = {value: class_id for class_id, value in enumerate(values)}
    train = train.select_columns([image_column, label_column]).cast_column(image_column, datasets.Image(decode=False))
    return train, eval_split, image_column, label_column, class_names, label_ids


def stream_for_this_process(stream, seed: int, process_index: int, num_processes: int):
    """This process's part of the shuffled stream. split_dataset_by_node gives each process whole shards when the
    process count divides the shard count, else every num_processes-th example of the one stream (every process
    then reads all shards). The shuffle (shard order and buffer) is seeded by --seed and the epoch (set_epoch), the
    same on every process, so that the parts never overlap."""
    from datasets.distributed import split_dataset_by_node

    shuffled = stream.shuffle(seed=seed, buffer_size=SHUFFLE_BUFFER_SIZE)
    return split_dataset_by_node(shuffled, rank=process_index, world_size=num_processes)


class StreamedImages(torch.utils.data.IterableDataset):
    """This process's part of the stream, decoded and transformed inside the DataLoader workers (datasets gives each
    worker its own shards): (uint8 image, class id) pairs.

    The random augmentations draw from a generator seeded by (seed, epoch, the image file's CRC-32): a stream has no
    index that every process count, worker count and resume agrees on, but a sample's bytes are the same everywhere.
    """

    def __init__(self, stream, transform, image_column: str, label_column: str, seed: int = 0, label_ids=None):
        self.stream, self.transform, self.seed, self.label_ids = stream, transform, seed, label_ids
        self.image_column, self.label_column = image_column, label_column
        # shared memory: persistent workers see set_epoch() of the main process (datasets shares the stream's too)
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        """The shuffle of the stream and the augmentations of epoch `epoch`."""
        self._epoch.fill_(epoch)
        self.stream.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def __iter__(self):
        for example in self.stream:
            image = example[self.image_column]  # {"bytes": ..., "path": ...}: bytes in parquet and tar files
            yield self.transformed(image_bytes(image), image.get("path")), self.class_id(example[self.label_column])

    def transformed(self, data: bytes, path=None) -> torch.Tensor:
        key = zlib.crc32(data)
        source = path or f"an image of the stream (CRC-32 {key:08x})"
        return decode_and_transform(data, self.transform, [self.seed, self.epoch, key], source)

    def class_id(self, label) -> int:
        if self.label_ids is None:
            return label
        if label not in self.label_ids:
            raise UserError(f"the training stream has the label {label!r}, which the evaluation split lacks; class "
                            f"ids come from the evaluation split's labels: give it at least one image of each class")
        return self.label_ids[label]


class StreamLoader:
    """This process's DataLoader of its part of the stream. Not a DataLoader, so that accelerator.prepare() leaves it as
    it is: Accelerate would split an iterable dataset across the processes again (or dispatch it from the main one)."""

    def __init__(self, dataloader):
        self.dataloader = dataloader

    def set_epoch(self, epoch: int) -> None:
        self.dataloader.dataset.set_epoch(epoch)


def epoch_batches(accelerator, dataloader, skip: int, accumulation_steps: int):
    """Collective for a stream (StreamLoader): the epoch's batches after the first `skip` (a resume inside the epoch).
    A prepared DataLoader: Accelerate's loader that skips the batches' indices (nothing is read)."""
    if isinstance(dataloader, StreamLoader):
        return batches_every_process_has(accelerator, dataloader, skip, accumulation_steps)
    return accelerator.skip_first_batches(dataloader, skip) if skip else dataloader


def batches_every_process_has(accelerator, loader: StreamLoader, skip: int, accumulation_steps: int):
    """Collective: this process's batches of the epoch, on the device, after the first `skip` (a resume inside the
    epoch: they are read and dropped), one accumulation cycle at a time while every process has a whole cycle left.
    Before each cycle every process says whether it has one (one tiny all-gather per cycle), so all of them stop at the
    same optimizer step whatever the sizes of their parts: no process waits forever in the next all-reduce of gradients.
    A resumed epoch reads its stream in the same order (the shuffle's seed and the split are the same) and skips."""
    from accelerate.utils import send_to_device

    batches, trained = iter(loader.dataloader), 0
    for _ in range(skip):
        next(batches, None)
    while True:
        cycle = [batch for _, batch in zip(range(accumulation_steps), batches)]  # takes no batch more
        have_a_cycle = torch.tensor([len(cycle) == accumulation_steps], device=accelerator.device)
        if not accelerator.gather(have_a_cycle).all():  # one flag per process
            if trained == 0 and skip == 0:
                raise UserError(f"a process's part of the stream holds fewer than {accumulation_steps} batch(es) of "
                                f"--batch_size: lower --batch_size or --gradient_accumulation_steps, or add data")
            return
        for batch in cycle:
            yield send_to_device(batch, accelerator.device, non_blocking=True)
        trained += 1
