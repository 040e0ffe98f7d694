"""--mixup_alpha, --cutmix_alpha, --mix_prob (issue 23): utils/mixing.MixedImages mixes each training image with a
partner chosen by (seed, epoch, index), in the DataLoader workers, through torchvision's v2.MixUp and v2.CutMix. The
pixels and targets it gives, whatever the order of access and the workers; train_accuracy with class weights as
targets; then real runs of train_image_classifier.py on 1, 2 and 3 processes that mix the same pairs into the same
pixels (tests/sample_recording.py logs every mixed sample), and a resumed run that ends with the uninterrupted run's
weights. The flags' refusals: tests/test_bad_inputs.py, test_bad_flag_values."""

import json
from collections import Counter

import pytest
import torch
from helpers import REPO, launcher_args, load_script, results, run_folder_of
from image_data import make_split_image_folder
from jobs import finished_job, launch_jobs

from utils.data.image_dataset import TransformedImages
from utils.data.image_loading import load_image_datasets
from utils.data.mixing import MixedImages
from utils.data.recipes import train_transform
from utils.errors import UserError
from utils.report.meters import RunningLoss, accuracy_credit
from utils.run.progress import TrainingProgress, read_training_state
from utils.run.run_folder import check_output_dir

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
MIXING = ["--mixup_alpha", "0.8", "--cutmix_alpha", "1.0", "--mix_prob", "0.8"]


class Squares(torch.utils.data.Dataset):
    """`images` (uint8, C x H x W each) with labels, and the epoch interface of TransformedImages."""

    def __init__(self, images, labels):
        self.images, self.labels, self.epoch = images, labels, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """48 training images of 4 classes, 8 for evaluation."""
    return make_split_image_folder(tmp_path_factory.mktemp("mixing_images"), train_per_class=12, val_per_class=2)


@pytest.fixture(scope="module")
def augmented(folder):
    """The training images as the script builds them at 16 px: decoded and augmented, seeded by (seed, epoch, index)."""
    train, _, image_column, label_column, _ = load_image_datasets(data_dir=folder)
    return TransformedImages(train, train_transform(16, "small", hflip=True), image_column, label_column, seed=7)


# ---------------------------------------------------------------- the mixed samples


def test_a_samples_mix_depends_on_seed_epoch_and_index_only(augmented):
    mixed = MixedImages(augmented, num_classes=4, mixup_alpha=0.8, cutmix_alpha=1.0, mix_prob=0.8, seed=7)
    mixed.set_epoch(1)
    assert augmented.epoch == 1  # one epoch for both: the workers see the augmentations' shared one
    in_order = [mixed[i] for i in range(len(mixed))]
    backwards = {i: mixed[i] for i in reversed(range(len(mixed)))}
    # 2 workers, batches of 5 in a shuffled order: each batch is the samples fetched alone, bit for bit
    order = torch.randperm(len(mixed), generator=torch.Generator().manual_seed(0)).tolist()
    loader = torch.utils.data.DataLoader(mixed, batch_size=5, sampler=order, num_workers=2)
    batches = list(loader)
    for start, (images, targets) in zip(range(0, len(order), 5), batches):
        indices = order[start:start + 5]
        assert torch.equal(images, torch.stack([in_order[i][0] for i in indices]))
        assert torch.equal(targets, torch.stack([in_order[i][1] for i in indices]))
    labels = [augmented.dataset[i][augmented.label_column] for i in range(len(mixed))]
    kinds = Counter()
    for index, (image, target) in enumerate(in_order):
        assert torch.equal(image, backwards[index][0]) and torch.equal(target, backwards[index][1])
        assert image.dtype == torch.uint8 and image.shape == (3, 16, 16)
        assert target.dtype == torch.float32 and target.shape == (4,) and target.sum().item() == pytest.approx(1)
        partner, kind, _ = mixed.pairing(1, index)
        kinds[kind] += 1
        lam = mixed.lam_of(1, index, 16, 16)
        expected = torch.zeros(4)
        expected[labels[index]] += lam
        if kind:
            assert partner != index and 0 <= partner < len(mixed)
            expected[labels[partner]] += 1 - lam
        else:
            assert (partner, lam) == (-1, 1.0)
            assert torch.equal(image, augmented[index][0])  # not mixed: the augmented image as it was
        assert torch.allclose(target, expected, atol=1e-7)
    assert kinds.keys() == {"", "mixup", "cutmix"}
    assert [mixed.pairing(0, i) for i in range(len(mixed))] != [mixed.pairing(1, i) for i in range(len(mixed))]


def test_mix_prob_0_gives_the_images_unchanged_with_one_hot_targets(augmented):
    mixed = MixedImages(augmented, num_classes=4, mixup_alpha=0.8, cutmix_alpha=1.0, mix_prob=0.0, seed=7)
    for index in range(len(mixed)):
        image, target = mixed[index]
        plain_image, label = augmented[index]
        assert torch.equal(image, plain_image)
        assert torch.equal(target, torch.nn.functional.one_hot(torch.tensor(label), 4).float())


def test_the_decisions_follow_mix_prob_and_timms_switch_prob():
    """mix_prob 0.3: about 30% of the samples mixed; with both methods on, half of those by CutMix; the partners
    uniform over the other samples."""
    dataset = Squares([torch.zeros(1, 2, 2, dtype=torch.uint8)] * 50, [0] * 50)
    both = MixedImages(dataset, num_classes=1, mixup_alpha=1.0, cutmix_alpha=1.0, mix_prob=0.3, seed=1)
    pairings = [both.pairing(epoch, index) for epoch in range(40) for index in range(50)]
    kinds = Counter(kind for _, kind, _ in pairings)
    assert kinds[""] / 2000 == pytest.approx(0.7, abs=0.03)
    assert kinds["cutmix"] / (kinds["mixup"] + kinds["cutmix"]) == pytest.approx(0.5, abs=0.05)
    assert all(partner != index % 50 for index, (partner, kind, _) in enumerate(pairings) if kind)
    with pytest.raises(UserError, match="mix two training images, and there is 1"):
        MixedImages(Squares(dataset.images[:1], [0]), num_classes=1, mixup_alpha=1.0)
    only_cutmix = MixedImages(dataset, num_classes=1, cutmix_alpha=1.0, seed=1)  # mix_prob 1: every sample
    pairings = [only_cutmix.pairing(epoch, index) for epoch in range(40) for index in range(50)]
    assert {kind for _, kind, _ in pairings} == {"cutmix"}
    partners = Counter(partner for partner, _, _ in pairings)
    assert sorted(partners) == list(range(50))
    chi_square = sum((count - 40) ** 2 / 40 for count in partners.values())  # 49 degrees of freedom: mean 49, sd 10
    assert chi_square < 90, partners


def test_cutmix_pastes_a_box_of_the_partner_covering_1_minus_lam_of_the_image():
    """Each image one grey level (index x 10) on a 20 x 24 (H x W) canvas: the pixels of the partner's level are the
    pasted box, a rectangle whose area is 1 - lam of the image, as lam_of says and the target weighs."""
    images = [torch.full((3, 20, 24), 10 * i, dtype=torch.uint8) for i in range(12)]
    mixed = MixedImages(Squares(images, [i % 3 for i in range(12)]), num_classes=3, cutmix_alpha=1.0, seed=5)
    pasted_somewhere = 0
    for index in range(12):
        image, target = mixed[index]
        partner, kind, _ = mixed.pairing(0, index)
        lam = mixed.lam_of(0, index, 20, 24)
        box = image[0] == 10 * partner
        assert kind == "cutmix" and torch.all((image == 10 * index) | box)  # the image's own pixels, or the partner's
        assert torch.equal(image, image[:1].expand(3, -1, -1))  # the same box in every channel
        rows, columns = box.any(dim=1), box.any(dim=0)
        assert torch.equal(box, rows[:, None] & columns[None, :])  # a rectangle
        assert lam == 1 - box.sum().item() / (20 * 24)
        own, other = index % 3, partner % 3
        if own != other:
            assert (target[own].item(), target[other].item()) == pytest.approx((lam, 1 - lam))
        pasted_somewhere += 0 < box.sum().item() < 20 * 24
    assert pasted_somewhere >= 6


def test_mixup_pixels_are_lam_a_plus_1_minus_lam_b_rounded():
    generator = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=generator) for _ in range(10)]
    mixed = MixedImages(Squares(images, list(range(10))), num_classes=10, mixup_alpha=0.4, seed=2)
    lams = []
    for index in range(10):
        image, target = mixed[index]
        partner, _, _ = mixed.pairing(0, index)
        lam = mixed.lam_of(0, index, 8, 8)
        a, b = images[index].float(), images[partner].float()
        # what v2.MixUp computes in float32 (b x (1 - lam) + a x lam), rounded to the nearest grey level
        assert torch.equal(image, (b * (1.0 - lam) + a * lam).round().to(torch.uint8)), index
        assert (image.float() - (lam * a + (1 - lam) * b)).abs().max() <= 0.5 + 1e-4  # at most half a grey level
        assert (target[index].item(), target[partner].item()) == pytest.approx((lam, 1 - lam))
        lams.append(lam)
    assert len(set(lams)) == 10 and 0 < min(lams) and max(lams) < 1


# ---------------------------------------------------------------- train_accuracy with class weights


def test_train_accuracy_credits_the_targets_weight_of_the_predicted_class():
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 1.0, 2.0], [0.0, 5.0, 1.0], [1.0, 0.0, 0.0]])  # predicts 0, 2, 1, 0
    mixed_targets = torch.tensor([[0.7, 0.3, 0.0], [0.0, 0.4, 0.6], [1.0, 0.0, 0.0], [0.25, 0.0, 0.75]])
    assert accuracy_credit(logits, mixed_targets).tolist() == pytest.approx([0.7, 0.6, 0.0, 0.25])
    class_ids = torch.tensor([0, 1, 1, 2])
    assert accuracy_credit(logits, class_ids).tolist() == [1.0, 0.0, 1.0, 0.0]  # plain accuracy
    one_hot = torch.nn.functional.one_hot(class_ids, 3).float()
    assert torch.equal(accuracy_credit(logits, one_hot), accuracy_credit(logits, class_ids))

    running = RunningLoss(torch.device("cpu"))
    running.add(torch.tensor(0.5), logits, mixed_targets, step=1)
    running.add(torch.tensor(2.0), logits[:2], class_ids[:2], step=2)
    loss_sum, samples, nonfinite_step, _, accuracy_sum = running.take().tolist()
    assert (loss_sum, samples, nonfinite_step) == (4 * 0.5 + 2 * 2.0, 6, -1)
    assert accuracy_sum == pytest.approx(0.7 + 0.6 + 0.0 + 0.25 + 1.0 + 0.0)
    assert running.take().tolist()[4] == 0  # taken: the next sums start afresh

    progress = TrainingProgress()  # what gather_running_loss adds up over the processes
    progress.add(6.0, 6, 2.55)
    progress.add(1.0, 2, 1.0)
    assert progress.end_epoch() == pytest.approx({"train_loss": 7.0 / 8, "train_accuracy": 3.55 / 8})
    assert (progress.epoch, progress.epoch_accuracy_sum, progress.samples_in_epoch) == (1, 0.0, 0)


def test_checkpoints_saved_before_train_accuracy_still_load(tmp_path):
    """At an epoch's end the accuracy starts from 0; mid-epoch its sum is unknown, so that epoch says None rather
    than a wrong number. A key of no known field is still refused."""
    saved = {name: value for name, value in vars(TrainingProgress(epoch=2, global_step=8)).items()
             if name != "epoch_accuracy_sum"}
    for name, samples_in_epoch, accuracy in (("epoch_1", 0, 0.0), ("step_9", 24, None)):
        (tmp_path / name).mkdir()
        state = {**saved, "samples_in_epoch": samples_in_epoch}
        (tmp_path / name / "training_state.json").write_text(json.dumps(state))
        progress = read_training_state(tmp_path / name)
        assert progress.epoch_accuracy_sum == accuracy and progress.global_step == 8
        progress.add(3.0, 8, 5.0)
        assert progress.end_epoch()["train_accuracy"] == (None if accuracy is None else 5.0 / 8)
    (tmp_path / "step_9" / "training_state.json").write_text(json.dumps({**saved, "unknown": 1}))
    with pytest.raises(UserError, match="not in this version's layout"):
        read_training_state(tmp_path / "step_9")


# ---------------------------------------------------------------- the script's flags


def test_without_the_flags_nothing_is_mixed(folder):
    script = load_script(CLASSIFIER)
    common = ["--data_dir", str(folder), "--image_size", "16"]
    plain = script.parse_args(common)
    assert (plain.mixup_alpha, plain.cutmix_alpha, plain.mix_prob) == (0.0, 0.0, None)
    # the same samples as before mixing existed
    assert type(script.build_datasets(plain, accelerator=None, progress=None)[0]) is TransformedImages
    # recorded as a run.json saved before the flags existed reads (no key: None), so its checkpoints still resume
    run = script.describe_run(plain)
    assert (run["mixup_alpha"], run["cutmix_alpha"], run["mix_prob"]) == (None, None, None)
    assert script.parse_args([*common, "--mixup_alpha", "0", "--cutmix_alpha", "0"]).mix_prob is None

    mixing = script.parse_args([*common, "--cutmix_alpha", "1.0"])
    assert mixing.mix_prob == 1.0  # timm's default
    dataset = script.build_datasets(mixing, accelerator=None, progress=None)[0]
    assert isinstance(dataset, MixedImages) and set(dataset.transforms) == {"cutmix"} and dataset.seed == 42
    run = script.describe_run(mixing)
    assert (run["mixup_alpha"], run["cutmix_alpha"], run["mix_prob"]) == (0.0, 1.0, 1.0)


# ---------------------------------------------------------------- runs on 1, 2 and 3 processes, and a resume


def recorded_job(*args) -> dict:
    """A job of `runs`: the classifier with ARGS, its mixed samples logged; processes out of step (a bug) fail after
    --ddp_timeout 60, a run still going at 300 s is killed."""
    return {"argv": [CLASSIFIER, "--cpu", *args, "--ddp_timeout", "60"], "record_samples": True, "timeout": 300}


def mixed_samples(log, rank):
    """[(epoch, index, partner, kind, lam, digest)] one process handed to training (its workers' lines in order: one
    worker per process here, else only their union is meaningful)."""
    lines = []
    for path in sorted(log.parent.glob(f"{log.name}.rank{rank}*")):
        if not path.name.endswith((".exit", ".out")):
            lines += [line.split() for line in path.read_text().splitlines()]
    return [(int(epoch), int(index), int(partner), kind, float(lam), digest)
            for epoch, index, partner, kind, lam, digest in lines]


# The 1-process run's flags: with a learning rate of 1e-30 its weights stay as they started, so the train loss test
# below computes its last epoch's logits again from model.safetensors (no workers: its samples logged in training order)
ONE_PROCESS = ["--batch_size", "12", "--num_workers", "0", "--learning_rate", "1e-30"]


@pytest.fixture(scope="module")
def runs(folder, tmp_path_factory):
    """2 epochs of 48 images in global batches of 12 (4 steps per epoch): on 1 process (no workers, ONE_PROCESS), 2
    (1 worker each, a checkpoint every 3 steps) and 3 (2 workers each); then the 2-process run resumed from step_6,
    mid-epoch 1, in the same launch as the run it resumes (tests/jobs.py). Each test reads the jobs it needs."""
    root = tmp_path_factory.mktemp("mixing_runs")
    two_processes = ["--batch_size", "6", "--num_workers", "1"]
    launch_jobs({"p1": recorded_job(*run_flags(folder, root / "p1"), *ONE_PROCESS)}, launcher_args(1), root)
    launch_jobs({
        "p2": recorded_job(*run_flags(folder, root / "p2"), *two_processes, "--checkpointing_steps", "3"),
        "resumed": recorded_job(*run_flags(folder, root / "resumed"), *two_processes, "--resume_from_checkpoint",
                            root / "p2" / "step_6"),
    }, launcher_args(2), root)
    launch_jobs({"p3": recorded_job(*run_flags(folder, root / "p3"), "--batch_size", "4", "--num_workers", "2")},
                launcher_args(3), root)
    return root


def run_flags(folder, output_dir) -> list:
    """What the runs above share."""
    return ["--data_dir", str(folder), "--output_dir", str(output_dir), "--model", "tests.tiny_model:tiny_cnn",
            "--image_size", "16", "--epochs", "2", "--optimizer", "adamw", "--warmup_epochs", "0",
            "--label_smoothing", "0.1", *MIXING]


def test_1_2_and_3_processes_mix_the_same_pairs_into_the_same_samples(runs):
    for n in (1, 2, 3):
        finished_job(runs / f"p{n}", n)
    per_count = {n: Counter(s for rank in range(n) for s in mixed_samples(runs / f"p{n}", rank)) for n in (1, 2, 3)}
    assert per_count[1] == per_count[2] == per_count[3]
    samples = per_count[1]
    assert sum(samples.values()) == 2 * 48 and max(samples.values()) == 1
    for epoch in (0, 1):  # each image once per epoch, mixed with that epoch's partner
        assert sorted(index for e, index, *_ in samples if e == epoch) == list(range(48))
    kinds = Counter(kind for _, _, _, kind, _, _ in samples)
    assert kinds.keys() == {"-", "mixup", "cutmix"} and kinds["-"] < kinds["mixup"] + kinds["cutmix"]
    pairs = [{(index, partner) for e, index, partner, *_ in samples if e == epoch} for epoch in (0, 1)]
    assert pairs[0] != pairs[1]
    for n in (1, 2, 3):
        r = results(runs / f"p{n}")
        assert (r["num_processes"], r["global_batch_size"], r["global_step"], r["samples_seen"]) == (n, 12, 8, 96)
        assert 0 <= r["train_accuracy"] <= 1 and r["train_loss"] > 0


def test_a_resumed_run_mixes_the_rest_and_ends_with_the_uninterrupted_runs_weights(runs):
    finished_job(runs / "p2", 2)
    finished_job(runs / "resumed", 2)
    uninterrupted, resumed = results(runs / "p2"), results(runs / "resumed")
    assert (runs / "resumed" / "model.safetensors").read_bytes() == (runs / "p2" / "model.safetensors").read_bytes()
    assert resumed["resumed_from"].endswith("step_6") and resumed["global_step"] == 8
    # epoch 1's sums cross the checkpoint (its training_state.json carries them): the same bits at the end
    assert (resumed["train_loss"], resumed["train_accuracy"]) == (uninterrupted["train_loss"],
                                                                  uninterrupted["train_accuracy"])
    assert resumed["eval_loss"] == uninterrupted["eval_loss"]
    for rank in range(2):  # after the first 6 steps (6 batches of 6 per process): the same samples, in order
        assert mixed_samples(runs / "resumed", rank) == mixed_samples(runs / "p2", rank)[36:]


def test_a_resume_that_changes_adds_or_drops_mixing_is_refused(runs, tmp_path):
    """In-process, as the script checks before it writes anything (tests/test_run_records.py runs that end to end)."""
    finished_job(runs / "p2", 2)
    script = load_script(CLASSIFIER)
    recorded = json.loads((runs / "p2" / "run.json").read_text())
    same = ["--data_dir", recorded["data"], "--image_size", "16", "--model", recorded["model"], "--optimizer", "adamw",
            "--warmup_epochs", "0", "--label_smoothing", "0.1", "--resume_from_checkpoint", "latest"]

    def check(checkpoint, *flags):
        args = script.parse_args([*same, "--output_dir", str(checkpoint.parent), *flags])
        check_output_dir(run_folder_of(script, args), checkpoint, args.resume_from_checkpoint)

    check(runs / "p2" / "step_6", *MIXING)  # its own flags: accepted
    for mixing, differences in ((["--mixup_alpha", "0.5", "--cutmix_alpha", "1.0"],
                                 ["mixup_alpha 0.8 -> 0.5", "mix_prob 0.8 -> 1.0"]),
                                ([], ["mixup_alpha 0.8 -> None", "cutmix_alpha 1.0 -> None", "mix_prob 0.8 -> None"])):
        with pytest.raises(UserError) as refused:
            check(runs / "p2" / "step_6", *mixing)
        assert all(difference in str(refused.value) for difference in differences), refused.value

    old = tmp_path / "out" / "step_4"  # saved before the flags existed: no such keys; resumes without them
    old.mkdir(parents=True)
    args = script.parse_args([*same, "--output_dir", str(old.parent)])
    (old / "run.json").write_text(json.dumps({k: v for k, v in script.describe_run(args).items() if "mix" not in k}))
    check(old)
    with pytest.raises(UserError, match="mixup_alpha None -> 0.8"):
        check(old, *MIXING)


def test_train_loss_and_accuracy_are_the_means_over_the_mixed_samples_trained(runs, folder):
    """The 1-process run's learning rate of 1e-30 left the weights as they started (BatchNorm's zero biases move by
    1e-30), so every batch's logits of its last epoch can be computed again here from model.safetensors, on the samples
    the recorder logged in training order (one process, no workers), rebuilt to the same bytes by the script's own
    build_datasets: train_loss is the mean smoothed cross-entropy against the mixed targets, train_accuracy the mean
    weight of each predicted class."""
    from safetensors.torch import load_file
    from sample_recording import digest_of
    from tiny_model import tiny_cnn

    from utils.data.device_input import normalise_on_device

    finished_job(runs / "p1")
    out = runs / "p1"
    trained = mixed_samples(runs / "p1", 0)
    assert [epoch for epoch, *_ in trained] == [0] * 48 + [1] * 48
    script = load_script(CLASSIFIER)
    dataset = script.build_datasets(script.parse_args([*run_flags(folder, out), *ONE_PROCESS]),
                                    accelerator=None, progress=None)[0]
    dataset.set_epoch(1)
    model = tiny_cnn(4)
    model.load_state_dict(load_file(out / "model.safetensors"))
    model.train()  # as in training: BatchNorm normalises by each batch's statistics
    loss_sum, credits = 0.0, []
    for start in range(48, 96, 12):
        batch = [dataset[index] for _, index, *_ in trained[start:start + 12]]
        assert [digest_of(*sample) for sample in batch] == [digest for *_, digest in trained[start:start + 12]]
        images, targets = torch.utils.data.default_collate(batch)
        with torch.no_grad():
            logits = model(normalise_on_device(images))
        loss_sum += torch.nn.functional.cross_entropy(logits, targets, label_smoothing=0.1).item() * 12
        credits += accuracy_credit(logits, targets).tolist()
    r = results(out)
    assert r["samples_seen"] == len(trained) == 96 and len(credits) == 48
    assert r["train_loss"] == pytest.approx(loss_sum / 48, rel=1e-6)  # the last epoch's
    assert r["train_accuracy"] == pytest.approx(sum(credits) / 48, abs=1e-12)
    assert any(0 < credit < 1 for credit in credits)  # a mixed image predicted as one of its two classes: part credit
