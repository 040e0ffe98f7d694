"""A log filter that makes Accelerate's info lines about saved files true (installed by utils/run/checkpoints.py)."""

import logging
import re
from pathlib import Path


class AccelerateSaveLines(logging.Filter):
    """Accelerate's info lines about saved files, made true. save_state logs one line per file into the
    temporary folder, renamed a moment later (save_checkpoint then logs one line for the final folder), and
    names sampler.bin, which it writes only for iterable datasets; save_model names pytorch_model.bin when it
    wrote model.safetensors. Those lines are dropped, or pointed at the file that was written; warnings and
    errors always pass. (The objects registered for checkpointing, --model_ema's average, get a line each too.)
    Under FSDP save_state and its helpers (accelerate/utils/fsdp_utils.py) say the same of the model's and the
    optimizer's shard folders, with two lines that name no folder ("Saving FSDP model"), dropped as well."""

    # after Accelerate's "[RANK N] " (its logging adapter's)
    SAVED = re.compile(r"^((?:.* )?(?:saved in|saved to(?: output dir)?|Saving current state to|Saving the state of \S+ "
                       r"to|Saving (?:model|Optimizer state) to) )(\S+)$")
    UNNAMED = re.compile(r"^(?:.* )?Saving FSDP (?:model|Optimizer)$")

    def __init__(self, tmp_prefix: str):
        super().__init__()
        self.tmp_prefix = tmp_prefix  # of the temporary folders that checkpoints are written into

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        match = self.SAVED.match(record.getMessage())
        if match is None:
            return not self.UNNAMED.match(record.getMessage())
        path = Path(match[2])
        if f"/{self.tmp_prefix}" in path.as_posix():
            return False
        if not path.exists() and path.name == "pytorch_model.bin" and path.with_name("model.safetensors").is_file():
            record.msg, record.args = f"{match[1]}{path.with_name('model.safetensors')}", ()
            return True
        return path.exists()
