"""train_mnist.py and train_image_classifier.py share the hard parts of the loop (start-up, resume,
checkpoints, signals, the loss bookkeeping, the end of a run). They are written out in both, so each
script reads top to bottom on its own; this test keeps the copies identical, so that a fix to one
cannot miss the other."""

import re

from helpers import REPO, TRAIN_MNIST, code_lines

CLASSIFIER = REPO / "scripts" / "train_image_classifier.py"
MARKER = re.compile(r"^(\s*)# shared: (.+)$")


def shared_blocks(path) -> dict:
    """{name: lines} for each block from a `# shared: name` line to the next blank line or the first
    line indented less than the marker."""
    lines = path.read_text().splitlines()
    blocks = {}
    for i, line in enumerate(lines):
        match = MARKER.match(line)
        if not match:
            continue
        indent, name = match.groups()
        block = []
        for following in lines[i + 1:]:
            if not following.strip() or len(following) - len(following.lstrip()) < len(indent):
                break
            block.append(following)
        assert name not in blocks, f"{path.name}: two blocks named {name!r}"
        blocks[name] = block
    return blocks


def test_the_shared_blocks_are_identical_in_both_scripts():
    mnist, classifier = shared_blocks(TRAIN_MNIST), shared_blocks(CLASSIFIER)
    assert set(mnist) == set(classifier) == {
        "start-up", "after the Accelerator", "resume or not", "the global batch", "resume, then the first write",
        "the optimizer step", "after each batch", "the end",
    }
    for name in mnist:
        assert len(mnist[name]) >= 3, f"block {name!r} is suspiciously short: the marker rules changed?"
        assert mnist[name] == classifier[name], f"the scripts' {name!r} blocks differ: change both or neither"


def test_a_changed_line_is_caught(tmp_path):
    """The comparison itself can fail: one edited line in a copy makes the blocks differ."""
    changed = tmp_path / "changed.py"
    changed.write_text(TRAIN_MNIST.read_text().replace("progress.global_step += 1", "progress.global_step += 2"))
    assert shared_blocks(changed)["after each batch"] != shared_blocks(TRAIN_MNIST)["after each batch"]


def test_both_mains_read_top_to_bottom_in_at_most_120_code_lines():
    """Issue 22: the loop stays visible and short; what is not about distribution lives in named functions."""
    assert code_lines(CLASSIFIER.read_text(), "main") <= 120
    assert code_lines(TRAIN_MNIST.read_text(), "main") <= 120
