import os
import shutil
import subprocess
import tempfile

import pytest

from doc_commands import help_cache
from helpers import EXIT_CHECK, make_synthetic_mnist, skip_or_fail_in_ci

# No network, and no user caches or `accelerate config` defaults leak into the tests. Set at
# import time: `datasets` and `huggingface_hub` read these when they are first imported, which
# happens while test modules are collected, before any fixture runs.
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="tests_hf_home_")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ.pop("ACCELERATE_CONFIG_FILE", None)
# Every Python process the tests start, however started (helpers.run, Popen, sbatch, a sweep's launches), skips the
# interpreter's last garbage collections at its exit (tests/exit_check/sitecustomize.py, FREEZE_AT_EXIT): about 0.8 s
# of CPU each. Its gloo-thread check writes only where helpers.run gives it a folder (EXIT_CHECK_DIR).
os.environ["FREEZE_AT_EXIT"] = "1"
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXIT_CHECK), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="module")
def accelerate_state():
    """The state Accelerate's logger needs, for in-process tests of helpers that log (one process, the CPU). Module
    scope: test_fsdp and test_predict reset Accelerate's state in the same worker."""
    from accelerate import PartialState

    PartialState(cpu=True)


@pytest.fixture
def another_process(accelerate_state, monkeypatch):
    """This process as process 1 of several: accelerate's logger says nothing with main_process_only=True."""
    from accelerate import PartialState

    monkeypatch.setitem(PartialState._shared_state, "process_index", 1)
    assert not PartialState().is_main_process


@pytest.fixture(scope="session")
def synthetic_mnist(tmp_path_factory):
    """640 train / 203 test generated digits as gzipped IDX files."""
    return make_synthetic_mnist(tmp_path_factory.mktemp("synthetic_mnist"))


@pytest.fixture(scope="session")
def helps():
    """--help texts of the programs the documents' commands run, fetched once per program."""
    return help_cache()


@pytest.fixture(scope="module")
def two_machines():
    """Machine 0 and machine 1 as two network namespaces joined by a veth pair, each with its
    own address: [(command prefix, address, interface)] for machines 0 and 1. Where namespaces
    cannot be made (not root, no `ip`) the test skips, saying why (in CI it fails): loopback on one
    machine would not show that the processes find each other across a network. One pair per test
    module (test_topologies.py, test_two_machine_restart.py)."""
    tag = f"acc{os.getpid() % 100000}"
    namespaces, links = [f"{tag}m0", f"{tag}m1"], [f"{tag}v0", f"{tag}v1"]
    subnet = f"10.213.{os.getpid() % 250}"
    addresses = [f"{subnet}.1", f"{subnet}.2"]
    setup = [
        *(["ip", "netns", "add", ns] for ns in namespaces),
        ["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]],
        *(["ip", "link", "set", link, "netns", ns] for link, ns in zip(links, namespaces)),
        *(["ip", "-n", ns, "addr", "add", f"{address}/30", "dev", link]
          for ns, address, link in zip(namespaces, addresses, links)),
        *(["ip", "-n", ns, "link", "set", dev, "up"] for ns, link in zip(namespaces, links) for dev in ("lo", link)),
    ]
    problem = None
    if shutil.which("ip") is None:
        problem = "the `ip` command (Debian package iproute2) is missing"
    elif os.geteuid() != 0:
        problem = "creating network namespaces needs root"
    else:
        for cmd in setup:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                problem = f"`{' '.join(cmd)}` failed: {proc.stderr.strip()}"
                break
    try:
        if problem is not None:
            skip_or_fail_in_ci(f"two machines as network namespaces: {problem}")
        yield [(["ip", "netns", "exec", ns], address, link) for ns, address, link in zip(namespaces, addresses, links)]
    finally:
        for ns in namespaces:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
