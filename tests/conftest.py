import pytest

from helpers import make_synthetic_mnist


@pytest.fixture(autouse=True, scope="session")
def hermetic_hub(tmp_path_factory):
    """No network and no user caches or `accelerate config` defaults leak into the tests."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("hf_home")))
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    mp.delenv("ACCELERATE_CONFIG_FILE", raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="session")
def synthetic_mnist(tmp_path_factory):
    """640 train / 203 test generated digits as gzipped IDX files."""
    return make_synthetic_mnist(tmp_path_factory.mktemp("synthetic_mnist"))
