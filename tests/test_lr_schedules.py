"""--lr_scheduler_type and --warmup_steps/--warmup_epochs (issue 23): each schedule's shape, step by step, here. In
real runs of both scripts, the schedule counted in optimizer steps (2 processes), where its shape says, recorded in
run.json, is checked on launches other modules make anyway (two launches fewer): train_mnist.py's onecycle with
--warmup_steps and gradient accumulation on test_training_features.py's early-stopped run
(test_train_mnist_counts_the_schedule_in_optimizer_steps), train_image_classifier.py's step schedule ending at a
hundredth on test_image_classifier.py's accumulation pair (test_train_image_classifier_step_schedule_ends_at_a_hundredth)."""

import math

import pytest
import torch
from helpers import REPO, load_script

from utils.launch.flags import LR_SCHEDULER_TYPES
from utils.run.optim import build_lr_scheduler, build_optimizer
from utils.run.steps import StepPlan

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
PEAK, TOTAL = 0.5, 40


def learning_rates(name, warmup_steps=None, warmup_epochs=None, steps_per_epoch=10, total=TOTAL, after=False) -> list:
    """The learning rate of each of `total` optimizer steps; `after`: and the rate after the last one (what a run's
    results.json records as current_learning_rate)."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK, momentum=0.9)
    plan = StepPlan(steps_per_epoch, max_steps=total)
    scheduler = build_lr_scheduler(optimizer, name, plan, warmup_steps, warmup_epochs)
    rates = []
    for _ in range(total):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return [*rates, optimizer.param_groups[0]["lr"]] if after else rates


@pytest.mark.parametrize("name", [n for n in LR_SCHEDULER_TYPES if n != "onecycle"])
def test_the_warmup_climbs_linearly_to_the_peak(name):
    rates = learning_rates(name, warmup_steps=4)
    assert rates[:5] == pytest.approx([PEAK / 4, PEAK / 2, 3 * PEAK / 4, PEAK, PEAK])
    assert learning_rates(name, warmup_epochs=0.4) == rates  # 0.4 epochs of 10 steps: the same 4 steps
    assert learning_rates(name, warmup_epochs=0.38) == rates  # 3.8 steps: rounded to the nearest step, 4
    assert max(rates) == pytest.approx(PEAK)


def test_each_shape_after_the_warmup():
    cosine, linear = learning_rates("cosine", warmup_steps=4), learning_rates("linear", warmup_steps=4)
    # step 4 + k of 36 decay steps
    assert cosine[4 + 18] == pytest.approx(PEAK / 2)
    assert cosine[4 + 9] == pytest.approx(PEAK * (1 + math.cos(math.pi / 4)) / 2)
    assert linear[4 + 18] == pytest.approx(PEAK / 2) and linear[-1] == pytest.approx(PEAK / 36)
    assert learning_rates("linear", warmup_steps=4, after=True)[-1] == 0.0  # exactly 0 once the run is done
    assert all(a >= b for a, b in zip(cosine[4:], cosine[5:])) and all(a > b for a, b in zip(linear[4:], linear[5:]))
    assert learning_rates("constant_with_warmup", warmup_steps=4)[4:] == pytest.approx([PEAK] * 36)
    step = learning_rates("step", warmup_steps=4)  # a tenth after each third of the 36 steps after the warmup
    assert step[4:] == pytest.approx([PEAK] * 12 + [PEAK / 10] * 12 + [PEAK / 100] * 12)
    assert learning_rates("cosine")[0] == PEAK  # no warmup unless asked (onecycle aside)


def test_onecycle_without_warmup_flags_is_the_mnist_recipe_exactly():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK, momentum=0.9)
    recipe = torch.optim.lr_scheduler.OneCycleLR(optimizer, PEAK, TOTAL, pct_start=0.15)
    expected = []
    for _ in range(TOTAL):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        recipe.step()
    assert learning_rates("onecycle") == expected
    rates = learning_rates("onecycle", warmup_steps=10)  # its rising phase: 10 steps, the peak after them
    assert max(rates) == pytest.approx(PEAK) and rates.index(max(rates)) == 9


def test_warmup_steps_replace_the_scripts_default_warmup_epochs():
    """train_image_classifier.py warms up 1 epoch by default; --warmup_steps replaces that (the two are exclusive)."""
    script = load_script(CLASSIFIER)
    assert (script.parse_args(["--data_dir", "d"]).warmup_epochs, script.parse_args(["--data_dir", "d"]).warmup_steps) \
        == (1.0, None)
    args = script.parse_args(["--data_dir", "d", "--warmup_steps", "5"])
    assert (args.warmup_epochs, args.warmup_steps) == (None, 5)


def test_the_optimizers_take_the_learning_rate_weight_decay_and_momentum_given():
    model = torch.nn.Linear(2, 2)
    (sgd,) = build_optimizer(model, "sgd", 0.1, 1e-4, momentum=0.8).param_groups
    assert isinstance(sgd["params"][0], torch.nn.Parameter) and len(sgd["params"]) == 2
    assert (sgd["lr"], sgd["weight_decay"], sgd["momentum"]) == (0.1, 1e-4, 0.8)
    adamw = build_optimizer(model, "adamw", 1e-3, 0.05)
    assert isinstance(adamw, torch.optim.AdamW)
    assert (adamw.param_groups[0]["lr"], adamw.param_groups[0]["weight_decay"]) == (1e-3, 0.05)

