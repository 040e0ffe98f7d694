import os
import tempfile

import pytest

from doc_commands import help_cache
from helpers import make_synthetic_mnist

# No network, and no user caches or `accelerate config` defaults leak into the tests. Set at
# import time: `datasets` and `huggingface_hub` read these when they are first imported, which
# happens while test modules are collected, before any fixture runs.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="tests_hf_home_")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.pop("ACCELERATE_CONFIG_FILE", None)


@pytest.fixture(scope="session")
def synthetic_mnist(tmp_path_factory):
    """640 train / 203 test generated digits as gzipped IDX files."""
    return make_synthetic_mnist(tmp_path_factory.mktemp("synthetic_mnist"))


@pytest.fixture(scope="session")
def helps():
    """--help texts of the programs the documents' commands run, fetched once per program."""
    return help_cache()
