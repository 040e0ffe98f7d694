#!/usr/bin/env python
"""MNIST trained the way DeepSpeedExamples' training/cifar/cifar10_deepspeed.py trains CIFAR-10, on Accelerate: the
"after" of scripts/baselines/deepspeed_mnist.py, each part of its ds_config written as the Accelerate call or torch
object it stands for, with as few other changes as possible, each marked `# [accelerate]`.

    accelerate launch --multi_gpu --num_processes 4 scripts/converted_deepspeed_style.py --data-dir path/to/MNIST/raw
    accelerate launch --multi_gpu --num_processes 2 scripts/converted_deepspeed_style.py --data-dir MNIST/raw --cpu

DeepSpeed's "Adam" is torch's AdamW (adam_w_mode defaults to true), its WarmupLR counts optimizer steps (so the
scheduler steps once per optimizer step, not once per process), train_batch_size is the global batch (split over
the processes here), gradient_clipping is clip_grad_norm_, and the fp16/bf16 blocks are Accelerate's mixed
precision. ZeRO has no line here: stages 0-2 train what DDP trains; to shard, see docs/fsdp.md, or keep DeepSpeed
under Accelerate (docs/converting_a_deepspeed_script.md: "Keeping DeepSpeed"). The test pass is sharded and
gathered (gather_for_metrics): each image counted once, as the before counts every image on every process.
"""

import argparse
import gzip
import math  # [accelerate] WarmupLR's log warm-up
import os  # [accelerate] what the launcher set
import sys  # [accelerate] the launch check's error
from pathlib import Path

import torch
import torch.distributed.nn  # [accelerate] before any process group: docs/migration_guide.md, "Ending a run cleanly"
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator, DataLoaderConfiguration  # [accelerate]
from accelerate.utils import GradScalerKwargs  # [accelerate]
from torch.utils.data import TensorDataset


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MNIST")
    # [accelerate] split over the processes below, as DeepSpeed splits train_batch_size
    parser.add_argument("-b", "--batch_size", default=64, type=int, help="global batch size: train_batch_size")
    parser.add_argument("-e", "--epochs", default=1, type=int, help="number of total epochs (default: 1)")
    parser.add_argument("--log-interval", type=int, default=1, help="output logging information at a given interval")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training")
    parser.add_argument("--data-dir", required=True, help="folder with the four gzipped MNIST IDX files")
    parser.add_argument("--train-samples", type=int, help="train on the first N training images only")
    parser.add_argument("--test-samples", type=int, help="test on the first N test images only")
    parser.add_argument("--save-model", metavar="PATH", help="save the trained weights here")
    # [accelerate] accelerate's examples' --cpu, for CPU processes where there are GPUs or none
    parser.add_argument("--cpu", action="store_true", help="train on the CPU even where there are GPUs")
    return parser.parse_args(argv)


# [accelerate] DeepSpeed's WarmupLR ("log", warmup_min_lr 0) as a LambdaLR factor of warmup_max_lr, its arithmetic
# kept (no library has this warm-up): it counts optimizer steps, and the first one trains at warmup_min_lr
def warmup_lr_lambda(warmup_num_steps):
    warmup_num_steps = max(2, warmup_num_steps)
    inverse_log_warm_up = 1.0 / math.log(warmup_num_steps)

    def factor(step):
        last_batch_iteration = step - 1  # WarmupLR starts at -1: its first optimizer step trains at warmup_min_lr
        if last_batch_iteration < 0:
            return 0.0
        if last_batch_iteration < warmup_num_steps:
            return inverse_log_warm_up * math.log(last_batch_iteration + 1)
        return 1.0

    return factor


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 4 * 4, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def load_split(data_dir, prefix, max_samples=None):
    """MNIST IDX: a 16-byte (images) or 8-byte (labels) header, then one byte per pixel or label."""

    def read(name, header_bytes):
        data = gzip.decompress((Path(data_dir) / f"{prefix}-{name}-ubyte.gz").read_bytes())
        return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header_bytes)

    images = read("images-idx3", 16).view(-1, 1, 28, 28)[:max_samples]
    labels = read("labels-idx1", 8).long()[:max_samples]
    return TensorDataset((images.float() / 255 - 0.1307) / 0.3081, labels)  # T.Normalize((0.1307,), (0.3081,))


def main(args):
    # [accelerate] the processes and their group come from `accelerate launch`; the ds_config's fp16/bf16 blocks are
    # mixed precision; the loader draws DistributedSampler's permutation of seed 0; the scheduler steps once per
    # optimizer step, as WarmupLR counts them (prepared, it would step once per process)
    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision={"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[args.dtype],
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0),
        step_scheduler_with_optimizer=False,
        # the fp16 block's dynamic loss scale: 2**initial_scale_power, grown after loss_scale_window clean steps
        kwargs_handlers=[GradScalerKwargs(init_scale=2.0**15, growth_interval=500)],
    )
    # [accelerate] without --cpu on a machine without GPUs, `accelerate launch --multi_gpu` starts lone processes
    if accelerator.num_processes != int(os.environ.get("WORLD_SIZE", 1)):
        sys.exit(f"error: accelerate launch started {os.environ['WORLD_SIZE']} processes, but they did not form one "
                 f"group: on a machine without GPUs add --cpu to the script's flags (and --multi_gpu to the launch's)")
    # [accelerate] DeepSpeed stops on fp16 without a GPU; Accelerate would train in fp32 without a word
    if args.dtype == "fp16" and accelerator.device.type == "cpu":
        accelerator.end_training()  # the group's gloo threads stopped before the exit
        sys.exit("error: --dtype fp16 needs a GPU: on CPU processes use --dtype bf16 or fp32")
    # [accelerate] train_batch_size is the global batch: each process loads its share, as DeepSpeed's micro batch
    if args.batch_size % accelerator.num_processes:
        accelerator.end_training()
        sys.exit(f"error: --batch_size {args.batch_size} does not split over {accelerator.num_processes} processes: "
                 f"give a multiple of {accelerator.num_processes}")

    with accelerator.main_process_first():  # [accelerate] rank 0 reads the data first, then the others
        trainset = load_split(args.data_dir, "train", args.train_samples)
        testset = load_split(args.data_dir, "t10k", args.test_samples)

    # [accelerate] the loader DeepSpeed built from training_data: shuffled, each process's share of the global batch
    trainloader = torch.utils.data.DataLoader(trainset, batch_size=args.batch_size // accelerator.num_processes,
                                              shuffle=True)
    testloader = torch.utils.data.DataLoader(testset, batch_size=64, shuffle=False)

    torch.manual_seed(1)  # the same weights every run (deepspeed.initialize broadcasts rank 0's to the others)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())

    # [accelerate] the ds_config's "optimizer": DeepSpeed's "Adam" is AdamW (adam_w_mode defaults to true): decoupled
    # weight decay, not torch.optim.Adam's L2 term in the gradient
    optimizer = torch.optim.AdamW(parameters, lr=0.001, betas=(0.8, 0.999), eps=1e-8, weight_decay=0.01)
    # [accelerate] the ds_config's "scheduler": WarmupLR sets the learning rate itself, from 0 up to warmup_max_lr
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lr_lambda(warmup_num_steps=4))

    # [accelerate] deepspeed.initialize: the model wrapped in DDP, the optimizer and scheduler wrapped, each loader
    # sharded (whole batches per process: the same global batch as DeepSpeed's sampler) and moved to the device
    model, optimizer, trainloader, testloader, scheduler = accelerator.prepare(net, optimizer, trainloader, testloader,
                                                                               scheduler)
    rank = accelerator.process_index  # [accelerate]

    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):  # loop over the dataset multiple times
        # [accelerate] DeepSpeed's loader never calls set_epoch (every epoch in epoch 0's order); this one reshuffles
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            # [accelerate] prepare() moved them to the device; mixed precision casts inside the forward (autocast)
            inputs, labels = data

            outputs = model(inputs)  # [accelerate]
            loss = criterion(outputs, labels)

            accelerator.backward(loss)  # [accelerate] model_engine.backward
            # [accelerate] model_engine.step: the ds_config's gradient_clipping, the optimizer, the scheduler
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

            # Print statistics, every process its own.
            running_loss += loss.item()
            if i % args.log_interval == args.log_interval - 1:
                print(f"[{epoch + 1}, {i + 1:5d}] rank {rank} loss: {running_loss / args.log_interval:.6f}"
                      f" lr: {scheduler.get_last_lr()[0]:.8g}")  # [accelerate]
                running_loss = 0.0
    print("Finished Training")

    # [accelerate] Test the network on every test image once: each process its shard, gathered
    correct = 0
    total = 0
    test_loss = 0.0
    model.eval()  # [accelerate]
    with torch.no_grad():
        for data in testloader:
            images, labels = data
            # [accelerate] every process's rows, without those repeated to even out the shards
            outputs, labels = accelerator.gather_for_metrics((model(images), labels))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels).sum().item()  # [accelerate]
            test_loss += F.cross_entropy(outputs.float(), labels, reduction="sum").item()  # [accelerate]

    if accelerator.is_main_process:  # [accelerate] one line, not one per process
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total:.4f} %,"
              f" loss {test_loss / total:.6f}")

    # [accelerate] the whole weights (under FSDP gathered from the shards: collective), written by the main process
    if args.save_model:
        accelerator.save(accelerator.get_state_dict(model), args.save_model)
    # [accelerate] release the DDP model first: end_training then stops gloo's threads before Python exits
    model, optimizer = accelerator.free_memory(model, optimizer)
    accelerator.end_training()


if __name__ == "__main__":
    main(parse_args())
