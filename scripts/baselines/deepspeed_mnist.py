#!/usr/bin/env python
"""MNIST trained the way DeepSpeedExamples' training/cifar/cifar10_deepspeed.py trains CIFAR-10: the "before" of
scripts/converted_deepspeed_style.py.

    deepspeed --num_gpus 4 scripts/baselines/deepspeed_mnist.py --data-dir path/to/MNIST/raw
    torchrun --nproc_per_node 2 scripts/baselines/deepspeed_mnist.py --data-dir path/to/MNIST/raw   # CPU processes

What the DeepSpeed example writes: argparse with deepspeed.add_config_arguments, deepspeed.init_distributed, the
data read by rank 0 first, a ds_config dict (train_batch_size, an "Adam" optimizer and a "WarmupLR" scheduler,
gradient_clipping, the fp16/bf16 blocks, a ZeRO stage) handed to deepspeed.initialize with the training set
(DeepSpeed builds the loader), model_engine.backward and model_engine.step, and a test pass over every test image on
every process. It reads the four gzipped MNIST IDX files instead of downloading them, its Net takes 1-channel 28x28
images, it prints every process's loss at every step with six decimals and the learning rate (the tests compare
them), "torch_adam": true picks torch's AdamW over DeepSpeed's fused kernel (the same update, nothing to compile on
a CPU), and --save-model writes the weights. `diff` it with the converted script to see the whole migration
(docs/converting_a_deepspeed_script.md walks through it).
"""

import argparse
import gzip
from pathlib import Path

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from torch.utils.data import TensorDataset


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="MNIST")
    parser.add_argument("-b", "--batch_size", default=64, type=int, help="global batch size: train_batch_size")
    parser.add_argument("-e", "--epochs", default=1, type=int, help="number of total epochs (default: 1)")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--log-interval", type=int, default=1, help="output logging information at a given interval")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training")
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--data-dir", required=True, help="folder with the four gzipped MNIST IDX files")
    parser.add_argument("--train-samples", type=int, help="train on the first N training images only")
    parser.add_argument("--test-samples", type=int, help="test on the first N test images only")
    parser.add_argument("--save-model", metavar="PATH", help="save the trained weights here")

    # Include DeepSpeed configuration arguments
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def get_ds_config(args):
    """Get the DeepSpeed configuration dictionary."""
    ds_config = {
        "train_batch_size": args.batch_size,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 0.001,
                "betas": [0.8, 0.999],
                "eps": 1e-8,
                "weight_decay": 0.01,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0,
                "warmup_max_lr": 0.001,
                "warmup_num_steps": 4,
            },
        },
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {
            "enabled": args.dtype == "fp16",
            "fp16_master_weights_and_grads": False,
            "loss_scale": 0,
            "loss_scale_window": 500,
            "hysteresis": 2,
            "min_loss_scale": 1,
            "initial_scale_power": 15,
        },
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": args.stage,
            "allgather_partitions": True,
            "reduce_scatter": True,
            "allgather_bucket_size": 50000000,
            "reduce_bucket_size": 50000000,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
    }
    return ds_config


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
    # Initialize DeepSpeed distributed backend.
    deepspeed.init_distributed()

    if torch.distributed.get_rank() != 0:
        # might be downloading the data, let rank 0 read it first
        torch.distributed.barrier()

    trainset = load_split(args.data_dir, "train", args.train_samples)
    testset = load_split(args.data_dir, "t10k", args.test_samples)

    if torch.distributed.get_rank() == 0:
        # the data is read, indicate other ranks can proceed
        torch.distributed.barrier()

    testloader = torch.utils.data.DataLoader(testset, batch_size=64, shuffle=False)

    torch.manual_seed(1)  # the same weights every run (deepspeed.initialize broadcasts rank 0's to the others)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())

    # Initialize DeepSpeed to use the following features.
    #   1) Distributed model.
    #   2) DeepSpeed optimizer and scheduler.
    #   3) Distributed data loader.
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=get_ds_config(args),
    )

    # Get the local device name (str) and local rank (int).
    local_device = get_accelerator().device_name(model_engine.local_rank)
    rank = torch.distributed.get_rank()

    # For float32, target_dtype will be None so no datatype conversion needed.
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):  # loop over the dataset multiple times
        running_loss = 0.0
        for i, data in enumerate(trainloader):
            # Get the inputs. ``data`` is a list of [inputs, labels].
            inputs, labels = data[0].to(local_device), data[1].to(local_device)

            # Try to convert to target_dtype if needed.
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)

            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)

            model_engine.backward(loss)
            model_engine.step()

            # Print statistics, every process its own.
            running_loss += loss.item()
            if i % args.log_interval == args.log_interval - 1:
                print(f"[{epoch + 1}, {i + 1:5d}] rank {rank} loss: {running_loss / args.log_interval:.6f}"
                      f" lr: {model_engine.get_lr()[0]:.8g}")
                running_loss = 0.0
    print("Finished Training")

    # Test the network on every test image, on every process.
    correct = 0
    total = 0
    test_loss = 0.0
    with torch.no_grad():
        for data in testloader:
            images, labels = data
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            _, predicted = torch.max(outputs.data, 1)
            total += labels.size(0)
            correct += (predicted == labels.to(local_device)).sum().item()
            test_loss += F.cross_entropy(outputs.float(), labels.to(local_device), reduction="sum").item()

    print(f"Accuracy of the network on the {total} test images: {100 * correct / total:.4f} %,"
          f" loss {test_loss / total:.6f}")

    # Every process calls it: under ZeRO-3 it gathers the shards (stage3_gather_16bit_weights_on_model_save);
    # rank 0 writes the weights in the dtype they trained in (fp32 here, whatever the name says).
    if args.save_model:
        model_engine.save_16bit_model(str(Path(args.save_model).parent), Path(args.save_model).name)


if __name__ == "__main__":
    main(parse_args())
