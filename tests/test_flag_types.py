"""The flag types of utils/launch/flags.py at their boundaries (0, 1, inf, nan, negative zero, another spelling), in
process: each is a function of one string. The scripts' parsers use them as they are (tests/test_bad_inputs.py parses
whole command lines); the launched runs need not try them. Issue 43: `--learning_rate inf` and `--val_split 0` were one
comparison away from being accepted without a test noticing."""

import argparse
import math

import pytest

from utils.launch import flags

# (type, texts it accepts with the value they mean, texts it refuses)
TYPES = {
    "positive_int": (flags.positive_int, {"1": 1, "7": 7, " 3": 3, "+2": 2}, ["0", "-1", "-0", "1.0", "1e3", "", "x"]),
    "non_negative_int": (flags.non_negative_int, {"0": 0, "-0": 0, "5": 5}, ["-1", "0.5", "nan", ""]),
    # --learning_rate, --max_grad_norm: inf would make the first step's weights non-finite, or clip nothing
    "positive_float": (flags.positive_float, {"1e-8": 1e-8, "3": 3.0, "1.5e300": 1.5e300},
                       ["0", "-0.0", "0.0", "-1e-9", "inf", "+inf", "Infinity", "-inf", "nan", "-nan", "", "one"]),
    "non_negative_float": (flags.non_negative_float, {"0": 0.0, "-0.0": 0.0, "0.9": 0.9, "1e300": 1e300},
                           ["-1e-300", "inf", "nan", "-inf", "x"]),
    "probability": (flags.probability, {"0": 0.0, "-0.0": 0.0, "1": 1.0, "0.5": 0.5, "1.0": 1.0},
                    ["1.0000001", "-1e-9", "nan", "inf", "2"]),
    # --val_split: both parts of the split keep images, so neither 0 nor 1
    "fraction": (flags.fraction, {"0.2": 0.2, "1e-9": 1e-9, "0.999999": 0.999999},
                 ["0", "0.0", "-0.0", "1", "1.0", "nan", "inf", "-0.2", "1.5"]),
    "label_smoothing": (flags.label_smoothing, {"0": 0.0, "-0.0": 0.0, "0.1": 0.1, "0.999": 0.999},
                        ["1", "1.0", "-1e-9", "nan", "inf"]),
    "ema_decay": (flags.ema_decay, {"0.9998": 0.9998, "1e-9": 1e-9}, ["0", "-0.0", "1", "nan", "inf", "x"]),
    "seed": (flags.seed, {"0": 0, "42": 42, str(2**32 - 1): 2**32 - 1}, [str(2**32), "-1", "1.5", "nan", ""]),
    "checkpointing_steps": (flags.checkpointing_steps, {"epoch": "epoch", "1": 1, "500": 500},
                            ["0", "-1", "Epoch", "epochs", "1.5", "inf", ""]),
}


@pytest.mark.parametrize("name", TYPES)
def test_each_flag_type_takes_its_range_and_refuses_the_boundaries_outside_it(name):
    convert, accepted, refused = TYPES[name]
    for text, value in accepted.items():
        assert convert(text) == value and type(convert(text)) is type(value), (name, text)
    for text in refused:
        with pytest.raises(argparse.ArgumentTypeError):
            convert(text)
            pytest.fail(f"{name} accepted {text!r}")


@pytest.mark.parametrize("convert, text, message", [
    (flags.positive_int, "0", "expected a positive integer, got 0"),
    (flags.positive_int, "1.5", "expected a positive integer, got '1.5'"),
    (flags.non_negative_int, "-1", "expected a whole number >= 0, got -1"),
    (flags.positive_float, "inf", "expected a positive number, got inf"),
    (flags.positive_float, "zero", "expected a positive number, got 'zero'"),
    (flags.non_negative_float, "nan", "expected a finite number >= 0, got nan"),
    (flags.non_negative_float, "x", "expected a number >= 0, got 'x'"),
    (flags.probability, "1.5", "expected a probability between 0 and 1, got 1.5"),
    (flags.fraction, "0", "expected a fraction strictly between 0 and 1, got 0"),
    (flags.label_smoothing, "1", "expected a number in [0, 1), got 1"),
    (flags.ema_decay, "1", "expected a decay between 0 and 1 (exclusive), got 1"),
    (flags.ema_decay, "x", "expected a number between 0 and 1, got 'x'"),
    (flags.seed, "-1", "expected 0 <= seed < 2**32 (numpy's range), got -1"),
    (flags.seed, "x", "expected a whole number, got 'x'"),
    (flags.checkpointing_steps, "0", "expected 'epoch' or a positive integer, got '0'"),
])
def test_a_refusal_names_what_was_expected_and_what_was_given(convert, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as refused:
        convert(text)
    assert str(refused.value) == message


@pytest.mark.parametrize("flag", ["--learning_rate", "--max_grad_norm"])
def test_an_infinite_learning_rate_or_clipping_norm_stops_the_parser_in_one_line(flag, capsys):
    """The shared parser's hyperparameters: one `error:` line, exit status 2."""
    parser = flags.build_parser("t", epochs=1, batch_size=8, learning_rate=0.1)
    with pytest.raises(SystemExit) as stopped:
        parser.parse_args([flag, "inf"])
    assert stopped.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"error: {parser.prog}: argument {flag}: expected a positive number, got inf (see --help)"


def test_the_shared_parser_keeps_the_scripts_defaults_and_the_values_given():
    parser = flags.build_parser("t", epochs=3, batch_size=64, learning_rate=3e-3)
    args = parser.parse_args([])
    assert (args.epochs, args.batch_size, args.learning_rate, args.seed, args.max_grad_norm) == (3, 64, 3e-3, 42, None)
    assert (args.gradient_accumulation_steps, args.ddp_timeout, args.report_to) == (1, 1800, "none")
    args = parser.parse_args(["--learning_rate", "1e-3", "--max_grad_norm", "1", "--checkpointing_steps", "epoch"])
    assert (args.learning_rate, args.max_grad_norm, args.checkpointing_steps) == (1e-3, 1.0, "epoch")


def test_no_accepted_float_is_nan_or_infinite():
    """What every float type shares, whatever its range: a value that passed is finite."""
    for name, (convert, accepted, _) in TYPES.items():
        for text in accepted:
            value = convert(text)
            assert not isinstance(value, float) or math.isfinite(value), (name, text)
