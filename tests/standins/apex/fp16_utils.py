"""Stand-in for `apex.fp16_utils` (tests/standins/README.md)."""


def to_python_float(tensor):
    return tensor.item() if hasattr(tensor, "item") else float(tensor)
