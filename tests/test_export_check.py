"""utils/predict/export.py's check of an ONNX export against PyTorch, in process: the logits of onnxruntime (one batch,
and one image at a time) against PyTorch's, refused above ONNX_TOLERANCE and whenever a nan makes the difference
unknown (issue 43: `not difference <= tolerance` turned into `difference > tolerance` wrote such a file). The export
itself, launched: tests/test_predict.py (a whole export in process takes 15 s here, so it is not repeated)."""

import numpy as np
import pytest

from utils.errors import UserError
from utils.predict.export import ONNX_TOLERANCE, check_against_pytorch

EXPECTED = np.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]], dtype=np.float32)


def test_logits_within_the_tolerance_pass_and_the_largest_difference_is_returned():
    assert check_against_pytorch(EXPECTED, EXPECTED.copy(), EXPECTED.copy()) == 0.0
    one_by_one = EXPECTED.copy()
    one_by_one[1, 2] += 5e-5
    whole = EXPECTED.copy()
    whole[0, 0] -= 2e-5
    assert check_against_pytorch(EXPECTED, whole, one_by_one) == pytest.approx(5e-5, rel=1e-2)


@pytest.mark.parametrize("where", ["whole", "one_by_one"])
@pytest.mark.parametrize("change", [2 * ONNX_TOLERANCE, -2 * ONNX_TOLERANCE, np.nan, np.inf])
def test_a_difference_above_the_tolerance_or_unknown_is_refused(where, change):
    """In either of onnxruntime's runs, in any row: a nan in the second row of the one-by-one run too (Python's max()
    over the rows would keep the first row's number)."""
    logits = {"whole": EXPECTED.copy(), "one_by_one": EXPECTED.copy()}
    logits[where][1, 1] += change
    with pytest.raises(UserError) as refused:
        check_against_pytorch(EXPECTED, logits["whole"], logits["one_by_one"])
    difference = abs(change)
    assert str(refused.value) == (f"the ONNX model's logits differ from PyTorch's by {difference:.2e} on 2 real inputs "
                                  f"(more than {ONNX_TOLERANCE}); not written. Report it with your torch and "
                                  f"onnxruntime versions")


def test_pytorchs_own_nan_logits_are_refused_as_such():
    expected = EXPECTED.copy()
    expected[1, 0] = np.nan
    with pytest.raises(UserError) as refused:
        check_against_pytorch(expected, expected.copy(), expected.copy())
    assert str(refused.value) == ("PyTorch's own logits are nan on 1 of 2 real inputs (nan in the weights?); not "
                                  "written: export a model whose predictions are numbers")

