"""Properties that must hold for every input, tried by Hypothesis over the whole range (issue 43: the examples the code
was written from hid its bugs): the resume arithmetic for any data set size, batch, process count and checkpoint step;
the global batch kept across process counts; the flag types at and around their boundaries; the class order of any
labels; the image modes over their whole value range. In process, a few seconds in all."""

import math
import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from PIL import Image
from test_resume_plan import process_batches

from utils.data.decoding import WIDE_GREYSCALE_MAX, viewer_rgb
from utils.data.labels import sorted_label_values
from utils.errors import UserError
from utils.launch import flags
from utils.run.progress import TrainingProgress
from utils.run.resume import accumulation_keeping, batches_to_skip

# deadline None and too_slow off: a shared machine's slow example is not a failure; database None: nothing written into
# the checkout; derandomize: the suite tries the same examples every run, so a run fails only where the code changed
# (HYPOTHESIS_RANDOM=1 draws new ones, to search further by hand)
FAST = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
                derandomize=os.environ.get("HYPOTHESIS_RANDOM") != "1")
LABEL_TEXT = st.text(alphabet="ab Z09_-é", max_size=4)  # a small alphabet: Hypothesis's table of all of Unicode takes
# seconds to build


pytestmark = pytest.mark.usefixtures("accelerate_state")  # conftest: accelerate's logger needs a state


geometry = dict(size=st.integers(1, 700), batch_size=st.integers(1, 40), num_processes=st.integers(1, 5),
                accumulation=st.integers(1, 4))


@FAST
@given(**geometry, data=st.data())
@example(size=1003, batch_size=24, num_processes=1, accumulation=1, data=None)  # issue 43's partial last batch
def test_a_resume_after_any_step_skips_exactly_the_batches_trained(size, batch_size, num_processes, accumulation,
                                                                   data):
    """After any optimizer step of an epoch (the last one too, perhaps after a partial batch or a short accumulation
    cycle), the samples the training loop counted give back the batches each process trained, and samples_seen
    counts them once."""
    per_process = [[len(batch) for batch in batches] for batches in process_batches(size, batch_size, num_processes)]
    batches_each = len(per_process[0])
    progress = TrainingProgress().with_batch(num_processes, batch_size, accumulation)
    steps = progress.steps_per_epoch(size, batch_size, whole_global_batches=False)
    assert steps == math.ceil(batches_each / accumulation)  # the optimizer steps Accelerate takes
    step = steps if data is None else data.draw(st.integers(0, steps), label="checkpoint step")
    trained = min(step * accumulation, batches_each)  # the last cycle is cut short at the end of the data
    counted = sum(sum(sizes[:trained]) for sizes in per_process)
    progress.add(loss_sum=0.0, samples=counted, accuracy_sum=0.0)
    assert batches_to_skip(progress, num_processes, batch_size) == trained
    assert progress.samples_seen == progress.samples_in_epoch == counted
    assert size <= sum(map(sum, per_process)) < size + num_processes * batch_size  # every sample, padding < a round


@FAST
@given(global_steps=st.integers(0, 50), old=st.tuples(st.integers(1, 8), st.integers(1, 64), st.integers(1, 8)),
       new_processes=st.integers(1, 8), new_batch_size=st.integers(1, 64))
def test_inside_an_epoch_any_geometry_that_keeps_the_global_batch_skips_the_same_samples(global_steps, old,
                                                                                         new_processes,
                                                                                         new_batch_size):
    """Checkpoints inside an epoch hold whole global batches: resumed on any processes and batch size whose
    accumulation keeps the global batch, the batches skipped hold exactly the samples trained."""
    progress = TrainingProgress().with_batch(*old)
    progress.add(0.0, global_steps * progress.global_batch_size, 0.0)
    try:
        accumulation = accumulation_keeping(progress, new_processes, new_batch_size, accumulation=1)
    except UserError:
        return  # the next test: refused only when no accumulation keeps it
    assert new_processes * new_batch_size * accumulation == progress.global_batch_size
    skip = batches_to_skip(progress, new_processes, new_batch_size)
    assert skip * new_processes * new_batch_size == progress.samples_in_epoch


@FAST
@given(old=st.tuples(st.integers(1, 8), st.integers(1, 64), st.integers(1, 8)),
       new_processes=st.integers(1, 16), new_batch_size=st.integers(1, 128), accumulation=st.integers(1, 8))
@example(old=(1, 48, 3), new_processes=9, new_batch_size=15, accumulation=1)  # 15 + 1 divides the 16 per process
def test_the_global_batch_is_kept_on_any_process_count_or_a_way_to_keep_it_is_named(old, new_processes, new_batch_size,
                                                                                   accumulation):
    target = old[0] * old[1] * old[2]
    progress = TrainingProgress().with_batch(*old)
    try:
        kept = accumulation_keeping(progress, new_processes, new_batch_size, accumulation)
    except UserError as refused:
        assert target % (new_processes * new_batch_size) != 0  # refused only when no accumulation keeps it
        suggestion = re.search(r"use --batch_size (\d+) --gradient_accumulation_steps (\d+)$", str(refused))
        if target % new_processes:
            assert suggestion is None and f"cannot be split over {new_processes} processes" in str(refused)
        else:
            batch, steps = map(int, suggestion.groups())
            assert new_processes * batch * steps == target and batch <= new_batch_size
            assert not any((target // new_processes) % larger == 0 for larger in range(batch + 1, new_batch_size + 1))
        return
    assert new_processes * new_batch_size * kept == target
    if new_processes * new_batch_size * accumulation == target:
        assert kept == accumulation


def float_texts():
    """Any float as a user may type it: repr (1e-300, inf, nan, -0.0) or plain text of the boundaries' neighbours."""
    special = st.sampled_from(["0", "-0", "-0.0", "0.0", "1", "1.0", "inf", "-inf", "Infinity", "nan", "-nan", "NaN",
                               "1e-320", "0.9999999999999999", "1.0000000000000002"])
    return st.one_of(special, st.floats(allow_nan=True, allow_infinity=True).map(repr),
                     st.floats(-2, 2).map(repr))


FLOAT_TYPES = {  # the range each accepts
    flags.positive_float: lambda x: 0 < x < math.inf,
    flags.non_negative_float: lambda x: 0 <= x < math.inf,
    flags.probability: lambda x: 0 <= x <= 1,
    flags.fraction: lambda x: 0 < x < 1,
    flags.label_smoothing: lambda x: 0 <= x < 1,
    flags.ema_decay: lambda x: 0 < x < 1,
}


@FAST
@given(text=float_texts())
def test_each_float_flag_accepts_exactly_its_range(text):
    value = float(text)
    for convert, in_range in FLOAT_TYPES.items():
        if in_range(value):  # never nan: every comparison with it is false
            assert convert(text) == value and math.isfinite(convert(text)), (convert.__name__, text)
        else:
            with pytest.raises(flags.argparse.ArgumentTypeError):
                convert(text)


@FAST
@given(value=st.one_of(st.integers(-2**40, 2**40), st.sampled_from([0, 1, -1, 2**32 - 1, 2**32])))
def test_each_integer_flag_accepts_exactly_its_range(value):
    for convert, in_range in ((flags.positive_int, value >= 1), (flags.non_negative_int, value >= 0),
                              (flags.seed, 0 <= value < 2**32), (flags.checkpointing_steps, value >= 1)):
        if in_range:
            assert convert(str(value)) == value
        else:
            with pytest.raises(flags.argparse.ArgumentTypeError):
                convert(str(value))


@FAST
@given(labels=st.one_of(st.lists(st.integers(-1000, 1000), min_size=1), st.lists(LABEL_TEXT, min_size=1)))
def test_any_labels_of_one_kind_get_one_order_whatever_the_order_of_the_rows(labels):
    """Numbers in numeric order, strings in string order; the rows' order does not matter (each split, every process
    and predict.py get the same class ids)."""
    values = sorted_label_values(labels, "s")
    assert values == sorted(set(labels)) and sorted_label_values(labels[::-1], "s") == values
    assert all(a < b for a, b in zip(values, values[1:]))


@FAST
@given(numbers=st.lists(st.integers(), min_size=1, max_size=5), strings=st.lists(LABEL_TEXT, min_size=1, max_size=5),
       seed=st.randoms())
def test_numbers_beside_strings_are_refused_in_one_line(numbers, strings, seed):
    labels = numbers + strings
    seed.shuffle(labels)
    with pytest.raises(UserError, match="the label column mixes int and str values; store every label as one type"):
        sorted_label_values(labels, "s")


@FAST
@given(value=st.integers(0, WIDE_GREYSCALE_MAX))
@example(value=WIDE_GREYSCALE_MAX)
@example(value=128)  # 0.498 of a level: down
@example(value=129)  # 0.502: up
def test_every_16_bit_level_scales_to_the_nearest_8_bit_one(value):
    rgb = viewer_rgb(Image.fromarray(np.full((1, 2), value, dtype=np.uint16)))
    assert rgb.shape == (1, 2, 3) and rgb.dtype == np.uint8 and len(np.unique(rgb)) == 1
    assert abs(int(rgb[0, 0, 0]) - value * 255 / WIDE_GREYSCALE_MAX) <= 0.5
    assert int(rgb[0, 0, 0]) == round(value / 257)  # 255 / 65535 = 1 / 257, never exactly half way between levels


@FAST
@given(values=st.lists(st.integers(-2**31, 2**31 - 1), min_size=2, max_size=8))
@example(values=[-70000, 70000, 65535, 65536, -1, 0])
def test_any_32_bit_level_is_clipped_to_16_bits_then_scaled_and_order_is_kept(values):
    image = Image.fromarray(np.array([values], dtype=np.int32))
    assert image.mode == "I"
    grey = viewer_rgb(image)[0, :, 0].astype(int)
    expected = [round(min(max(value, 0), WIDE_GREYSCALE_MAX) / 257) for value in values]
    assert grey.tolist() == expected
    order = np.argsort(values, kind="stable")
    assert all(np.diff(grey[order]) >= 0)  # brighter stays brighter


@FAST
@given(value=st.integers(0, 255), mode=st.sampled_from(["L", "P", "1"]))
def test_8_bit_levels_are_kept_as_they_are(value, mode):
    assume(mode != "1" or value in (0, 255))
    image = Image.fromarray(np.full((1, 1), value, dtype=np.uint8))
    if mode == "P":
        image = image.convert("P")
    elif mode == "1":
        image = image.convert("1")
    assert viewer_rgb(image)[0, 0].tolist() == [value] * 3
