#!/usr/bin/env python
"""MNIST trained the way Horovod's examples/pytorch/pytorch_mnist.py trains it: the "before" of
scripts/converted_horovod_style.py.

    horovodrun -np 4 -H localhost:4 python scripts/baselines/horovod_mnist.py --data-dir path/to/MNIST/raw
    python scripts/baselines/horovod_mnist.py --data-dir path/to/MNIST/raw     # one process

What the Horovod examples write: hvd.init, the GPU pinned to hvd.local_rank(), a DistributedSampler per split
over hvd.size() and hvd.rank(), the learning rate scaled by hvd.size(), broadcast_parameters and
broadcast_optimizer_state, DistributedOptimizer (with fp16 compression, Adasum or a gradient predivide factor),
torch.cuda.amp with synchronize()/skip_synchronize(), and test metrics averaged over the workers with
hvd.allreduce. It reads the four gzipped MNIST IDX files instead of downloading them, and saves the weights from
rank 0 as Horovod's documentation advises. Horovod cannot be installed here: the tests run this script on the
stand-in in tests/standins/horovod, over torch.distributed under torchrun. `diff` it with the converted script to
see the whole migration (docs/converting_a_horovod_script.md walks through it).
"""

import argparse
import gzip
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
from torch.utils.data import TensorDataset

# Training settings
parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                    help="input batch size for training (per worker)")
parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N", help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR", help="learning rate of one worker")
parser.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed")
parser.add_argument("--log-interval", type=int, default=10, metavar="N", help="batches between training logs")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--use-mixed-precision", action="store_true", default=False,
                    help="use mixed precision for training")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer")
parser.add_argument("--data-dir", required=True, help="folder with the four gzipped MNIST IDX files")
parser.add_argument("--train-samples", type=int, help="train on the first N training images only")
parser.add_argument("--test-samples", type=int, help="test on the first N test images only")
parser.add_argument("--save-model", metavar="PATH", help="save the trained weights here (rank 0)")


class Net(nn.Module):
    """Horovod's Net without its two dropouts: masks drawn in each process would make a comparison on two
    processes depend on which process holds which sample."""

    def __init__(self):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def load_split(data_dir, prefix, max_samples=None):
    """MNIST IDX: a 16-byte (images) or 8-byte (labels) header, then one byte per pixel or label."""

    def read(name, header_bytes):
        data = gzip.decompress((Path(data_dir) / f"{prefix}-{name}-ubyte.gz").read_bytes())
        return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header_bytes)

    images = read("images-idx3", 16).view(-1, 1, 28, 28)[:max_samples]
    labels = read("labels-idx1", 8).long()[:max_samples]
    return TensorDataset((images.float() / 255 - 0.1307) / 0.3081, labels)  # transforms.Normalize((0.1307,), (0.3081,))


def train(args):
    def train_mixed_precision(epoch, scaler):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            with torch.autocast("cuda"):
                output = model(data)
                loss = F.nll_loss(output, target)

            scaler.scale(loss).backward()
            # Make sure all async allreduces are done
            optimizer.synchronize()
            # In-place unscaling of all gradients before weights update
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            # Update scaler in case of overflow/underflow
            scaler.update()

            if batch_idx % args.log_interval == 0:
                # Horovod: use train_sampler to determine the number of examples in this worker's partition.
                print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}\tLoss Scale: {}".format(
                    epoch, batch_idx * len(data), len(train_sampler),
                    100. * batch_idx / len(train_loader), loss.item(), scaler.get_scale()))

    def train_epoch(epoch):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0:
                # Horovod: use train_sampler to determine the number of examples in this worker's partition.
                print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                    epoch, batch_idx * len(data), len(train_sampler),
                    100. * batch_idx / len(train_loader), loss.item()))

    def metric_average(val, name):
        tensor = torch.tensor(val)
        avg_tensor = hvd.allreduce(tensor, name=name)
        return avg_tensor.item()

    def test():
        model.eval()
        test_loss = 0.
        test_accuracy = 0.
        with torch.no_grad():
            for data, target in test_loader:
                if args.cuda:
                    data, target = data.cuda(), target.cuda()
                output = model(data)
                # sum up batch loss
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                # get the index of the max log-probability
                pred = output.data.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum().item()

        # Horovod: use test_sampler to determine the number of examples in this worker's partition.
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)

        # Horovod: average metric values across workers.
        test_loss = metric_average(test_loss, "avg_loss")
        test_accuracy = metric_average(test_accuracy, "avg_accuracy")

        # Horovod: print output only on first rank.
        if hvd.rank() == 0:
            print("\nTest set: Average loss: {:.6f}, Accuracy: {:.4f}% ({} samples)\n".format(
                test_loss, 100. * test_accuracy, len(test_sampler) * hvd.size()))

    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    elif args.use_mixed_precision:
        raise ValueError("Mixed precision is only supported with cuda enabled.")

    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)

    kwargs = {"num_workers": 1, "pin_memory": True} if args.cuda else {}
    train_dataset = load_split(args.data_dir, "train", args.train_samples)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler, **kwargs)

    test_dataset = load_split(args.data_dir, "t10k", args.test_samples)
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler, **kwargs)

    model = Net()

    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1

    if args.cuda:
        # Move model to GPU.
        model.cuda()
        # If using GPU Adasum allreduce, scale learning rate by local_size.
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    if args.use_mixed_precision:
        # Initialize scaler in global scale
        scaler = torch.amp.GradScaler("cuda")

    for epoch in range(1, args.epochs + 1):
        if args.use_mixed_precision:
            train_mixed_precision(epoch, scaler)
        else:
            train_epoch(epoch)
        # Keep test in full precision since computation is relatively light.
        test()

    # Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
    if hvd.rank() == 0 and args.save_model:
        torch.save(model.state_dict(), args.save_model)
    hvd.shutdown()


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    train(args)
