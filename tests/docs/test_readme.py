"""README.md's one-process examples run as a reader would paste them, and prints what it says.

The README's first examples need 4 and 3 ranks (``examples/demo.py`` runs that story, checked by
``test_examples.py``); the training-loop example runs in one process, and a reader may run it
again: the second run must resume from the checkpoints the first left, not fail on them.
"""

from __future__ import annotations

import contextlib
import io
import re

import torch

from tests.docs.test_docs import blocks_in
from tests.support.paths import REPO

README = REPO / "README.md"


def _manager_block() -> str:
    found = [b for b in blocks_in(README.read_text(), "README.md", ("python",)) if "CheckpointManager(" in b.code]
    assert len(found) == 1, "README.md has one CheckpointManager example"
    return found[0].code


def _run(code: str) -> tuple[dict, str]:
    namespace: dict = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), namespace)
    return namespace, out.getvalue()


def test_the_training_loop_example_resumes_when_run_again(tmp_path, monkeypatch):
    code = _manager_block()
    (promised,) = re.findall(r"print\(mgr\.steps\(\)\)\s*#\s*(\[.*\])", code)
    monkeypatch.chdir(tmp_path)

    first, printed = _run(code)
    assert printed.strip() == promised
    second, printed = _run(code)
    assert printed.strip() == promised
    # The second run trained nothing: it restored the model and the optimizer of the last step.
    assert second["start"] == 7
    for name, value in first["model"].state_dict().items():
        assert torch.equal(second["model"].state_dict()[name], value), name
    assert second["opt"].state_dict()["state"][0]["step"] == first["opt"].state_dict()["state"][0]["step"] == 6
