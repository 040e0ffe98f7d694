"""run.json, the record of what defines a run: its name, the keys a resume may change, and reading it back."""

import json
from pathlib import Path

from ..errors import UserError
from ..output_files import RUN_RECORD

# run.json keys a resume may change (utils/run/run_folder.py start_output_dir records them beside the run's own; epochs,
# max_steps: train_image_classifier.py only); best/ keeps those of its time
RESUMABLE_KEYS = {"epochs", "max_steps", "early_stopping_patience", "num_processes", "batch_size_per_process",
                  "gradient_accumulation_steps", "global_batch_size"}


def read_run_record(folder):
    """The run.json in `folder` (a checkpoint), or None where there is none (saved before runs were recorded)."""
    path = Path(folder) / RUN_RECORD
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is unreadable ({type(err).__name__}); use another checkpoint") from None
