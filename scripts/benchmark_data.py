#!/usr/bin/env python
"""Benchmark the image input pipeline: images decoded and augmented per second per CPU core.

    python scripts/benchmark_data.py --data_dir path/to/photos --output_dir my_benchmark_data
    python scripts/benchmark_data.py --data_dir path/to/photos --num_workers 0 2 4 --target_images_per_second 3000

--data_dir is an image folder in the ImageFolder layout, DIR/train/<class>/*.jpg and
DIR/val/<class>/* (or DIR/validation/): the train split is timed with the training transform
of the recipe for --image_size, the val split with the evaluation transform. Four pipelines,
each through a real DataLoader with batches of --batch_size:

- before: the pipeline as of before issue 20 (frozen below): `datasets` imagefolder decodes a PIL
  image, torchvision's v2 transforms, float normalisation in the worker, seeded per sample;
- reference: the plain PyTorch way (pytorch/examples): torchvision's ImageFolder, the same v2
  transforms, float normalisation in the worker, no per-sample seeds;
- decode_only: PIL's full decode of each file and nothing else: the floor;
- ours: utils/data/ as it is now, built as scripts/train_image_classifier.py builds it.

For each split and --num_workers, the pipelines take turns (--rounds times), so a slow moment
of a shared machine hurts them alike; each figure is the median over rounds. A measurement
starts after the workers have started and delivered their first batch and lasts at least
--seconds. Per core: images/s divided by the cores doing the work, max(1, workers); the main
process runs on one thread, as workers do. With 0 workers the CPU time of that one process is
measured too (images per CPU-second): other jobs on the machine do not lower it, so the
summary's ratios on one core use it. Written to OUTPUT_DIR: benchmark_data.json (rows,
summary ratios, machine, command) and benchmark_data.md (the table).
"""

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # find utils/ from a plain clone
from utils.benchmark.environment import machine_facts, portable_command, portable_path
from utils.data.image_dataset import TransformedImages, collate_images
from utils.data.image_loading import load_image_datasets
from utils.data.recipes import default_hflip, eval_transform, resolve_augmentation, train_transform
from utils.errors import UserError, exit_with_error
from utils.files import create_output_dir, write_json_atomically
from utils.launch.flags import ArgumentParser, non_negative_int, positive_float, positive_int, seed

PIPELINES = ("before", "reference", "decode_only", "ours")
SPLITS = ("train", "eval")
EVAL_FOLDERS = ("val", "validation")
RATIOS = (("ours", "before"), ("ours", "decode_only"), ("reference", "before"))
COLLATE_FNS = {"ours": collate_images}  # as the training script's loaders batch them; the others: default_collate


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data_dir", required=True, help="DIR/train/<class>/* and DIR/val/<class>/*")
    parser.add_argument("--output_dir", default="benchmark_data", help="benchmark_data.json and benchmark_data.md")
    parser.add_argument("--image_size", type=positive_int, default=224, help="side of the crops, as in training")
    parser.add_argument("--augmentation", choices=["auto", "imagenet", "small", "none"], default="auto",
                        help="training recipe, as in scripts/train_image_classifier.py")
    parser.add_argument("--batch_size", type=positive_int, default=32)
    parser.add_argument("--num_workers", type=non_negative_int, nargs="+", default=[0, 1, 2],
                        help="DataLoader workers to time")
    parser.add_argument("--seconds", type=positive_float, default=3.0, help="time measured per pipeline and round")
    parser.add_argument("--rounds", type=positive_int, default=3, help="turns of every pipeline; the median is kept")
    parser.add_argument("--seed", type=seed, default=42, help="the training script's default")
    parser.add_argument("--target_images_per_second", type=positive_float, default=3000,
                        help="what one GPU trains on: the cores per GPU the train pipeline needs for it is printed")
    args = parser.parse_args(argv)
    args.num_workers = sorted(set(args.num_workers))
    args.augmentation = resolve_augmentation(args.augmentation, args.image_size)
    args.hflip = default_hflip(args.augmentation)
    return args


# --- The pipeline as of before issue 20 (utils/image_data.py at 62a3e8d), kept for comparison. ---
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _before_train_transform(image_size, recipe, hflip):
    from torchvision.transforms import v2  # here, as in utils/data/recipes.py: --help need not import it
    if recipe == "imagenet":
        geometry = [v2.RandomResizedCrop(image_size, antialias=True)]
    elif recipe == "small":
        geometry = [_before_whole_image(image_size), v2.RandomAffine(degrees=0, scale=(0.9, 1.1)),
                    v2.RandomCrop(image_size, padding=image_size // 8, padding_mode="reflect")]
    else:
        geometry = [_before_whole_image(image_size)]
    return _before_normalised(*geometry, *([v2.RandomHorizontalFlip()] if hflip else []))


def _before_eval_transform(image_size, recipe):
    from torchvision.transforms import v2  # here, as in utils/data/recipes.py: --help need not import it
    if recipe == "imagenet":
        return _before_normalised(v2.Resize(round(image_size / 0.875), antialias=True), v2.CenterCrop(image_size))
    return _before_normalised(_before_whole_image(image_size))


def _before_whole_image(image_size):
    from torchvision.transforms import v2  # here, as in utils/data/recipes.py: --help need not import it
    return v2.Resize((image_size, image_size), antialias=True)


def _before_normalised(*geometry):
    from torchvision.transforms import v2  # here, as in utils/data/recipes.py: --help need not import it
    return v2.Compose([*geometry, v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


class _BeforeImages(torch.utils.data.Dataset):
    """TransformedImages of then: `datasets` decodes a PIL image, transformed under a per-sample seed."""

    def __init__(self, dataset, transform, seed=0):
        self.dataset, self.transform, self.seed = dataset, transform, seed
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        example = self.dataset[index]
        image = example["image"].convert("RGB")
        sample_seed = np.random.SeedSequence([self.seed, int(self._epoch), index]).generate_state(1)[0]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(sample_seed))
            pixels = self.transform(image)
        return pixels, example["label"]
# --- end of the pipeline before issue 20 ---


class _DecodeOnly(torch.utils.data.Dataset):
    """PIL's full decode of each file and nothing else; only the size travels back, so no copy is timed."""

    def __init__(self, samples):
        self.samples = samples  # (path, class id), as ImageFolder lists them

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        from PIL import Image  # imported once per worker; --help need not import it

        path, label = self.samples[index]
        with Image.open(path) as image:
            return torch.tensor(image.convert("RGB").size), label  # convert() decodes the whole image


def image_folders(data_dir) -> dict:
    """{split: folder} in the ImageFolder layout, or one clear error."""
    root = Path(data_dir)
    if not root.is_dir():
        raise UserError(f"--data_dir {data_dir}: no such directory; point it at an image folder "
                        f"DIR/train/<class>/*.jpg with DIR/val/<class>/*.jpg")
    folders = {"train": root / "train", "eval": next((root / n for n in EVAL_FOLDERS if (root / n).is_dir()), None)}
    missing = [name for name, folder in (("train/", folders["train"]), ("val/", folders["eval"]))
               if folder is None or not folder.is_dir()]
    if missing:
        raise UserError(f"--data_dir {data_dir}: no {' and no '.join(missing)} folder; expected the ImageFolder "
                        f"layout DIR/train/<class>/*.jpg and DIR/val/<class>/*.jpg")
    return folders


def build_pipelines(args) -> dict:
    """{pipeline: {split: Dataset}}, all reading the same images."""
    import datasets
    from torchvision.datasets import ImageFolder

    folders = image_folders(args.data_dir)
    try:
        files = {split: ImageFolder(folder) for split, folder in folders.items()}
    except FileNotFoundError as err:  # a class folder without images, or no class folders at all
        raise UserError(f"--data_dir {args.data_dir}: {err}; put the images in DIR/train/<class>/ and "
                        f"DIR/val/<class>/") from None
    size, recipe, hflip = args.image_size, args.augmentation, args.hflip
    splits = datasets.load_dataset("imagefolder", data_dir=str(args.data_dir))
    # ours: exactly as scripts/train_image_classifier.py builds it (its eval dataset keeps the default seed)
    train_split, eval_split, image_column, label_column, _ = load_image_datasets(data_dir=args.data_dir)
    columns = (image_column, label_column)
    pipelines = {
        "before": {"train": _BeforeImages(splits["train"], _before_train_transform(size, recipe, hflip), args.seed),
                   "eval": _BeforeImages(splits["validation"], _before_eval_transform(size, recipe))},
        # the same v2 transforms as before, as pytorch/examples applies them
        "reference": {"train": ImageFolder(folders["train"], _before_train_transform(size, recipe, hflip)),
                      "eval": ImageFolder(folders["eval"], _before_eval_transform(size, recipe))},
        "decode_only": {split: _DecodeOnly(found.samples) for split, found in files.items()},
        "ours": {"train": TransformedImages(train_split, train_transform(size, recipe, hflip), *columns,
                                            seed=args.seed),
                 "eval": TransformedImages(eval_split, eval_transform(size, recipe), *columns)},
    }
    for split in SPLITS:  # a ratio between pipelines that read different images would mean nothing
        lengths = {name: len(datasets_[split]) for name, datasets_ in pipelines.items()}
        if len(set(lengths.values())) != 1:
            raise UserError(f"--data_dir {args.data_dir}: the pipelines find different numbers of {split} images "
                            f"({lengths}); keep only image files in the class folders")
    return pipelines


class _Passes(torch.utils.data.Sampler):
    """Pass after pass over the split in one iterator: no pause at the end of a pass, as on a large data set.
    (So the workers start once per measurement, and persistent_workers would change nothing.)"""

    def __init__(self, length):
        self.length = length

    def __iter__(self):
        return itertools.cycle(range(self.length))


def measure(dataset, num_workers: int, batch_size: int, seconds: float, collate_fn=None):
    """(images, seconds, CPU seconds of this process) of at least `seconds` of steady loading, worker start-up
    excluded."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=_Passes(len(dataset)),
                                         num_workers=num_workers, collate_fn=collate_fn)
    batches = iter(loader)
    # The workers start together, so their first batches arrive at once: skip one per worker and count
    # whole turns of the workers from there, or a batch made before the clock started would count.
    turn = max(1, num_workers)
    for _ in range(turn):
        next(batches)
    images, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        for _ in range(turn):
            images += len(next(batches)[1])
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    del batches  # stops the workers now, before the next pipeline is timed
    return images, elapsed, cpu


def run_benchmark(args, pipelines) -> dict:
    """{(pipeline, split, num_workers): [(images, seconds, CPU seconds) per round]}, the pipelines taking turns."""
    runs = {}
    settings = [(split, n) for split in SPLITS for n in args.num_workers]
    with tqdm(total=len(settings) * args.rounds * len(PIPELINES), desc="benchmark_data", unit="run") as progress:
        for split, num_workers in settings:
            for _ in range(args.rounds):
                for name in PIPELINES:
                    progress.set_postfix_str(f"{split}/{num_workers} workers/{name}")
                    result = measure(pipelines[name][split], num_workers, args.batch_size, args.seconds,
                                     COLLATE_FNS.get(name))
                    runs.setdefault((name, split, num_workers), []).append(result)
                    progress.update(1)
    return runs


def rows_of(runs) -> list:
    rows = []
    for (name, split, num_workers), results in runs.items():
        rate = statistics.median(images / seconds for images, seconds, _ in results)
        rows.append({
            "pipeline": name, "split": split, "num_workers": num_workers,
            "images_per_second": rate, "images_per_second_per_core": rate / max(1, num_workers),
            "per_core_by_round": [images / seconds / max(1, num_workers) for images, seconds, _ in results],
            # one process does all the work: its CPU time is the core's, whatever else the machine runs
            "images_per_cpu_second": (statistics.median(images / cpu for images, _, cpu in results)
                                      if num_workers == 0 else None),
            "images": sum(images for images, _, _ in results), "seconds": sum(seconds for _, seconds, _ in results),
            "rounds": len(results),
        })
    return rows


def summary_of(runs, args) -> dict:
    """{split: {"ours/before": {num_workers: ratio}, ...}}: the median over rounds of each round's ratio
    (both sides of a ratio were timed one after the other, on the machine in the same state); with 0 workers,
    of images per CPU-second."""
    def ratio(a, b, split, n):
        pairs = zip(runs[a, split, n], runs[b, split, n], strict=True)
        return statistics.median((images_a / (cpu_a if n == 0 else seconds_a)) /
                                 (images_b / (cpu_b if n == 0 else seconds_b))
                                 for (images_a, seconds_a, cpu_a), (images_b, seconds_b, cpu_b) in pairs)

    return {split: {f"{a}/{b}": {n: ratio(a, b, split, n) for n in args.num_workers} for a, b in RATIOS}
            for split in SPLITS}


def cores_per_gpu(rows, args) -> dict:
    """Cores one GPU needs to be fed --target_images_per_second by the train pipeline, from the rate per core
    with the most workers timed (the setting closest to a training run's)."""
    most = max(args.num_workers)
    per_core = {r["pipeline"]: r["images_per_second_per_core"] for r in rows
                if r["split"] == "train" and r["num_workers"] == most}
    return {"target_images_per_second": args.target_images_per_second, "num_workers": most,
            "cores": {name: args.target_images_per_second / rate for name, rate in per_core.items()}}


def results_text(rows, summary, cores, args) -> list:
    """The table (images/s per core, a column per worker count, and per CPU-second with 0 workers), the ratios and
    the cores per GPU, as lines."""
    by_key = {(r["pipeline"], r["split"], r["num_workers"]): r for r in rows}
    cpu = 0 in args.num_workers  # the column of images per CPU-second
    lines = ["| pipeline | split | " + " | ".join(workers(n) for n in args.num_workers)
             + (" | 0 workers, per CPU-second |" if cpu else " |"),
             "|---|---|" + "--:|" * (len(args.num_workers) + cpu)]
    for split in SPLITS:
        for name in PIPELINES:
            cells = [f"{by_key[name, split, n]['images_per_second_per_core']:.0f}" for n in args.num_workers]
            if cpu:
                cells.append(f"{by_key[name, split, 0]['images_per_cpu_second']:.0f}")
            lines.append(f"| {name} | {split} | " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {split}, {pair}: " + ", ".join(f"{r:.2f}x with {workers(n)}" for n, r in by_workers.items())
              for split in SPLITS for pair, by_workers in summary[split].items()]
    lines.append("- with 0 workers the ratios are of images per CPU-second; issue 20 asks of `ours` on one core: at "
                 "least 2x `before`, at least 0.8x `decode_only`")
    return [*lines, "", cores_line(cores)]


def markdown(rows, summary, cores, args, record) -> str:
    machine, rounds = record["machine"], f"{args.rounds} round{'' if args.rounds == 1 else 's'}"
    about = (f"`{record['command']}` on {machine['cpu']} ({machine['cpu_cores']} cores, load average "
             f"{machine['load_average_1min_before']:.1f} before, {machine['load_average_1min_after']:.1f} after), "
             f"commit {machine['git_commit']}, torch {machine['torch']}, torchvision {machine['torchvision']}. "
             f"Image size {args.image_size} (train: recipe {args.augmentation}{', flips' if args.hflip else ''}), "
             f"batches of {args.batch_size}; median of {rounds} of at least {args.seconds:g} s each; "
             f"a core per DataLoader worker, one for 0 workers.")
    lines = ["# Input pipeline: images per second per core", "", about, "",
             *results_text(rows, summary, cores, args), ""]
    return "\n".join(lines)


def cores_line(cores) -> str:
    need = cores["cores"]
    return (f"At {cores['target_images_per_second']:g} images/s per GPU (--target_images_per_second), the train "
            f"pipeline `ours` needs {need['ours']:.1f} cores per GPU (before: {need['before']:.1f}; reference: "
            f"{need['reference']:.1f}; decode only: {need['decode_only']:.1f}), at the rates per core with "
            f"{workers(cores['num_workers'])}.")


def workers(n) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


def main(args):
    load_before = os.getloadavg()[0]  # a busy machine makes every number smaller: recorded with them
    pipelines = build_pipelines(args)  # a wrong folder fails here, before anything is written
    create_output_dir(args.output_dir)
    # One thread, as in a DataLoader worker: with 0 workers the main process then uses one core too.
    torch.set_num_threads(1)
    runs = run_benchmark(args, pipelines)

    rows = rows_of(runs)
    summary, cores = summary_of(runs, args), cores_per_gpu(rows, args)
    record = {
        "command": portable_command(["python", *sys.argv], REPO),  # as typed, in the folder it was started in
        "machine": {**machine_facts(), "load_average_1min_before": load_before},
        "settings": {k: portable_path(v, REPO) if isinstance(v, str) else v for k, v in vars(args).items()},
        "images_in_split": {split: len(pipelines["decode_only"][split]) for split in SPLITS},
        "rows": rows, "summary": summary, "cores_per_gpu": cores,
    }
    output_dir = Path(args.output_dir)
    write_json_atomically(output_dir / "benchmark_data.json", record)
    (output_dir / "benchmark_data.md").write_text(markdown(rows, summary, cores, args, record))
    print("\n".join(results_text(rows, summary, cores, args)))
    print(f"Wrote {output_dir / 'benchmark_data.json'} and benchmark_data.md")


if __name__ == "__main__":
    try:
        main(parse_args())
    except UserError as err:
        exit_with_error(err, status=2)  # 2, as for a wrong flag: nothing was measured
