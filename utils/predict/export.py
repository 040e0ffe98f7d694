"""scripts/predict.py --export onnx: the trained model as one ONNX file that takes uint8 images, checked against
PyTorch with onnxruntime before it is written. Needs the optional packages of requirements-export.txt."""

import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import UserError, first_line

ONNX_TOLERANCE = 1e-4  # largest absolute difference of the logits to PyTorch's (fp32) that the export accepts


class UInt8Images(nn.Module):
    """The deployable model: uint8 images (N, C, H, W), RGB (MNIST: one grey channel), resized and cropped as the
    run's evaluation does, in; logits (N, classes) out. The normalisation the input pipeline does on the device
    (`normalise`) happens inside, so a deployment feeds decoded pixels and has no mean or std to get wrong."""

    def __init__(self, model: nn.Module, normalise):
        super().__init__()
        self.model, self.normalise = model, normalise

    def forward(self, images):
        return self.model(self.normalise(images))


def export_onnx(model: nn.Module, normalise, images: torch.Tensor, path, class_names: list) -> float:
    """Writes `normalise` + `model` to `path` as ONNX (input "images", uint8, dynamic batch; output "logits"; the
    class names in its metadata), after running it with onnxruntime on `images` (real inputs) in one batch and
    one image at a time and comparing with PyTorch in fp32 on the CPU. Returns the largest absolute difference;
    above ONNX_TOLERANCE nothing is written. Main process only: no collective."""
    try:
        import onnx
        import onnxruntime
        import onnxscript  # noqa: F401  (torch.onnx.export's converter)
    except ImportError as err:
        raise UserError(f"--export onnx needs the optional packages onnx, onnxscript and onnxruntime ({err.name} is "
                        f"missing); pip install -r requirements-export.txt") from None
    deployable = UInt8Images(model.float().cpu().eval(), normalise).eval()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        example = images[:1].repeat(2, 1, 1, 1)  # any batch of two or more: one would fix the batch size at 1
        batch = torch.export.Dim("batch")
        try:
            torch.onnx.export(deployable, (example,), str(tmp), input_names=["images"], output_names=["logits"],
                              dynamic_shapes=({0: batch},), external_data=False, verbose=False)
        except Exception as err:  # an operator without an ONNX translation, a model torch.export cannot trace
            raise UserError(f"torch.onnx.export cannot convert this model ({type(err).__name__}: {first_line(err)}); "
                            f"predict with PyTorch instead (without --export)") from None
        exported = onnx.load(str(tmp))
        onnx.helper.set_model_props(exported, {"class_names": json.dumps(class_names)})  # class id i: class_names[i]
        onnx.save(exported, str(tmp))
        session = onnxruntime.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
        with torch.no_grad():
            expected = deployable(images).numpy()
        whole = session.run(None, {"images": images.numpy()})[0]
        one_by_one = [session.run(None, {"images": image[None].numpy()})[0][0] for image in images]
        difference = check_against_pytorch(expected, whole, np.stack(one_by_one))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return difference


def check_against_pytorch(expected: np.ndarray, whole: np.ndarray, one_by_one: np.ndarray) -> float:
    """The largest absolute difference of onnxruntime's logits, of the inputs in one batch (`whole`) and one at a time
    (`one_by_one`), to PyTorch's (`expected`), all (N, classes); UserError when it is above ONNX_TOLERANCE or nan (any
    logit nan: numpy's max keeps a nan, where Python's max() drops one that is not first)."""
    difference = float(np.abs(np.stack([whole, one_by_one]) - expected).max())
    if np.isnan(expected).any():
        raise UserError(f"PyTorch's own logits are nan on {int(np.isnan(expected).any(axis=1).sum())} of "
                        f"{len(expected)} real inputs (nan in the weights?); not written: export a model whose predictions "
                        f"are numbers")
    if not difference <= ONNX_TOLERANCE:  # also nan
        raise UserError(f"the ONNX model's logits differ from PyTorch's by {difference:.2e} on {len(expected)} real "
                        f"inputs (more than {ONNX_TOLERANCE}); not written. Report it with your torch and "
                        f"onnxruntime versions")
    return difference
