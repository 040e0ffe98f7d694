"""Files written whole: JSON and text replaced atomically, a writable file and the output folder checked or made."""

import json
import os
import tempfile
from pathlib import Path

from .errors import UserError


def write_json_atomically(path, data: dict) -> None:
    """Readers see the old file or the new one, never half of one."""
    write_text_atomically(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def write_text_atomically(path, text: str) -> None:
    """Into a temporary file beside `path`, renamed over it once complete: readers see the old file or the new
    one, never half of one, and a crash or Ctrl-C while writing leaves no `path` that looks finished."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when writing failed


def check_writable_file(path, flag: str) -> None:
    """Before any work: `path` can be written (its folder exists or can be made, and takes a new file)."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "it is a folder")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as err:
        raise UserError(f"cannot write {flag} {path} ({err.strerror or type(err).__name__}); choose a file in a "
                        f"writable folder") from None


def create_output_dir(output_dir) -> None:
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create --output_dir {output_dir} ({err.strerror}); choose a writable folder") from None
