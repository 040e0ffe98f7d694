"""Stand-in for NVIDIA apex (tests/standins/README.md): `apex.amp` at opt level O0 with a static loss scale,
`apex.parallel` as PyTorch's DDP, `apex.fp16_utils.to_python_float`."""

from apex import amp, fp16_utils, parallel  # noqa: F401  (import apex; apex.parallel.convert_syncbn_model)
