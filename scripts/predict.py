#!/usr/bin/env python
"""Predict with the weights a training run wrote, on any number of processes, into one CSV file.

    accelerate launch scripts/predict.py --model_dir outputs --data_dir new_photos --output_file predictions.csv
    accelerate launch scripts/predict.py --model_dir outputs/best --data_dir path/to/MNIST/raw --output_file p.csv
    python scripts/predict.py --model_dir outputs --data_dir photos --export onnx     # writes outputs/model.onnx

The model (architecture, classes and their names, image size, stem, normalisation) is rebuilt from the run's
run.json and results.json, never typed again here; the inputs go through the run's evaluation pipeline. The
file has one row per input, in input order, byte for byte the same on any number of processes, and appears
only when complete. Calls that every process must make together are marked `# [collective]`.
"""

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed.nn  # imported before the process group: see the end of main()
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # find utils/ from a plain clone
from utils.data.device_input import model_input_dtype, normalise_on_device
from utils.data.image_dataset import collate_images
from utils.data.mnist import normalise_mnist
from utils.errors import UserError, exit_with_error
from utils.files import check_writable_file, write_text_atomically
from utils.launch.flags import ArgumentParser, default_num_workers, non_negative_int, positive_int
from utils.launch.launch_checks import check_accelerator, check_enough_devices
from utils.predict.prediction_rows import WholeBatches, predictions_csv
from utils.predict.trained_run import WEIGHT_FILES, build_trained_model, read_inputs, read_trained_run


def parse_args(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0],
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model_dir", type=Path, required=True,
                        help="a training run's --output_dir (or its best/): model.safetensors, run.json, results.json")
    parser.add_argument("--weights", choices=sorted(WEIGHT_FILES), default="model",
                        help="model: model.safetensors, the trained weights; ema: model_ema.safetensors, the moving "
                             "average of a --model_ema run")
    data = parser.add_argument_group("inputs (MNIST runs: --data_dir with the IDX files, or neither for ylecun/mnist)")
    source = data.add_mutually_exclusive_group()
    source.add_argument("--data_dir", help="MNIST IDX files; an image folder (DIR/<class>/*, DIR/train|val/<class>/*); "
                                           "or a folder of unlabelled images (no class folders), read whole")
    source.add_argument("--dataset", help="Hugging Face Hub dataset, or a local folder of data files")
    data.add_argument("--dataset_config", default=None, help="default: the run's, for the run's own --dataset")
    data.add_argument("--image_column", default=None, help="default: the run's, or the dataset's Image column")
    data.add_argument("--label_column", default=None, help="default: the run's, or the dataset's ClassLabel column")
    data.add_argument("--split", choices=["eval", "train", "all"], default="eval",
                      help="eval: what the run evaluated on, chosen the same way (a val/test folder or split, else the "
                           "run's --val_split of the folder); all: train, then eval")
    data.add_argument("--max_samples", type=positive_int, default=None, help="only the first N inputs")
    data.add_argument("--num_workers", type=non_negative_int, default=None,
                      help="DataLoader processes per process; default: none for MNIST, else as in training")
    out = parser.add_argument_group("output")
    out.add_argument("--output_file", type=Path, default=None,
                     help="the CSV: index, source (file, or SPLIT/ROW), label (if known), class_1, probability_1, ... "
                          "class_K, probability_K, error (why an input could not be read)")
    out.add_argument("--top_k", type=positive_int, default=5, help="classes per row, most probable first")
    out.add_argument("--on_error", choices=["row", "stop"], default="row",
                     help="an image that cannot be decoded: a row naming it and why, or stop with one error line, "
                          "writing nothing")
    out.add_argument("--export", choices=["onnx"], default=None,
                     help="instead of predicting, write the model as ONNX: input 'images', uint8 (N, C, H, W) RGB "
                          "(MNIST: N, 1, 28, 28) resized as the run's evaluation does, normalised inside the model; "
                          "output 'logits'; dynamic batch; checked with onnxruntime on the first --batch_size inputs "
                          "(pip install -r requirements-export.txt)")
    out.add_argument("--export_file", type=Path, default=None,
                     help="default: MODEL_DIR/model.onnx (model_ema.onnx with --weights ema)")
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--batch_size", type=positive_int, default=64, help="per process")
    hardware.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                          help="overrides the launch config (accelerate config / --config_file)")
    hardware.add_argument("--cpu", action="store_true", help="run on the CPU even if GPUs are present")
    hardware.add_argument("--channels_last", action="store_true", help="NHWC memory format: faster on GPUs")
    args = parser.parse_args(argv)
    if args.output_file is None and args.export is None:
        parser.error("--output_file is required (or --export onnx, to export the model instead)")
    return args


def export(model, trained, batches, description, args):
    """--export onnx: the model with its fp32 input normalisation, checked with onnxruntime on the first
    --batch_size inputs that can be decoded."""
    from utils.predict.export import export_onnx  # its optional packages only for --export

    examples = [batches[i] for i in range(min(args.batch_size, len(batches.inputs)))]
    images = [image for image, _, _, unreadable in examples if not unreadable]
    if not images:
        raise UserError(f"none of the first {len(examples)} inputs can be decoded, so the export cannot be checked; "
                        f"point --data_dir at readable images")
    path = args.export_file or trained.folder / Path(trained.weights).with_suffix(".onnx").name
    normalise = normalise_mnist if trained.is_mnist else normalise_on_device
    difference = export_onnx(model, normalise, torch.stack(images), path, trained.class_names)
    print(f"Wrote {path}: uint8 images in, normalised inside, logits out, any batch size; on {len(images)} real "
          f"inputs ({description}) onnxruntime's logits are within {difference:.1e} of PyTorch's", flush=True)


def main(args):
    check_enough_devices(args.cpu)
    # the run's records, and --weights: a missing or mismatched folder stops here
    trained = read_trained_run(args.model_dir, WEIGHT_FILES[args.weights])
    if args.output_file is not None:
        check_writable_file(args.output_file, "--output_file")  # before the work, not after it
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision,
        dataloader_config=DataLoaderConfiguration(non_blocking=True),  # copies of pinned batches overlap compute
    )
    check_accelerator(accelerator)
    # [collective] the main process reads the folder (or downloads) and builds the datasets cache; the others wait
    with accelerator.main_process_first():
        inputs = read_inputs(trained, args.data_dir, args.dataset, args.split, args.dataset_config,
                             args.image_column, args.label_column).first(args.max_samples)
    model = build_trained_model(trained)
    # The batches stay uint8 up to the device, where they become the model's input, as in training's evaluation.
    if trained.is_mnist:
        normalise = normalise_mnist
    else:
        input_dtype = model_input_dtype(accelerator.mixed_precision)  # the launch config's precision
        normalise = partial(normalise_on_device, dtype=input_dtype, channels_last=args.channels_last)
    batches = WholeBatches(inputs.dataset, args.batch_size, inputs.blank, stop_on_error=args.on_error == "stop")

    if args.export:  # instead of predicting: one process's work, the others wait
        if accelerator.is_main_process:
            export(model, trained, batches, inputs.description, args)
        accelerator.wait_for_everyone()  # [collective]
        accelerator.end_training()
        return 0

    model = model.to(accelerator.device)  # no prepare(): without training there is nothing to sync
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    num_workers = args.num_workers if args.num_workers is not None else 0 if trained.is_mnist else default_num_workers()
    dataloader = DataLoader(batches, batch_size=args.batch_size, num_workers=num_workers, collate_fn=collate_images,
                            pin_memory=accelerator.device.type == "cuda")  # channels-last uint8 batches, as in training
    dataloader = accelerator.prepare(dataloader)  # process k takes batches k, k+N, ..., on its device
    top_k = min(args.top_k, len(trained.class_names))
    columns = ([], [], [], [], [])  # positions, unreadable flags, labels, top-k class ids, their probabilities
    progress_bar = tqdm(total=len(dataloader), disable=not accelerator.is_local_main_process)
    start = time.perf_counter()
    for images, labels, positions, unreadable in dataloader:
        with torch.no_grad(), accelerator.autocast():
            logits = model(normalise(images))
        probabilities, classes = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
        # [collective] every process's rows; drops the batches repeated to give all processes equally many
        gathered = accelerator.gather_for_metrics((positions, unreadable, labels, classes, probabilities))
        for column, values in zip(columns, gathered):
            column.append(values.cpu())
        progress_bar.update(1)
    progress_bar.close()
    seconds = time.perf_counter() - start

    if accelerator.is_main_process:  # one writer
        text, counts = predictions_csv(columns, inputs, batches, trained.class_names, top_k)
        write_text_atomically(args.output_file, text)  # a temporary file renamed: only a complete file appears
        count, labelled = len(inputs.dataset), counts["labelled"]
        accuracy = f"accuracy {counts['correct'] / labelled:.4f} on {labelled} labelled inputs, " if labelled else ""
        run_precision = trained.results.get("mixed_precision")  # what the run's eval_accuracy was computed in
        if labelled and run_precision not in (None, accelerator.mixed_precision):
            accuracy += (f"not necessarily the run's eval_accuracy: it evaluated in precision {run_precision} "
                         f"(--mixed_precision {run_precision} to repeat it), ")
        print(f"Predicted {count} inputs ({inputs.description}) in {seconds:.2f} s: {count / seconds:.1f} images/s "
              f"on {accelerator.num_processes} process(es), precision {accelerator.mixed_precision}; {accuracy}"
              f"{counts['unreadable']} unreadable; wrote {args.output_file}", flush=True)
    # end the process group: no gloo thread is left to abort the exit
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(parse_args()))
    except UserError as err:
        exit_with_error(err)
