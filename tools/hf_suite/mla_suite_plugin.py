"""pytest plugin: transformers' own model tests, every MLA model they build run by ``mla.hf.patch``.

Loaded with ``-p mla_suite_plugin`` (``tools/hf_suite`` on ``PYTHONPATH``) in a pytest run of a
transformers checkout's ``tests/models/<family>/test_modeling_<family>.py`` (``tools/hf_suite/run.py``
drives it; docs/hf.md, "transformers' own tests").

``--mla-patch``: a model is patched when it first runs, at its first call or ``generate``, so that
what a test does to it before (``from_pretrained``, ``load_state_dict``, ``.to``, ``.eval``) reaches
mla's layers as it reaches transformers' modules. Only a top-level model is patched: an inner model
called by a patched one already runs on the stand-ins. A model without MLA attention modules
(an assistant model of another family) stays as it is.

``--mla-report PATH``: one JSON line a test, ``{"test", "outcome", "message"}``, outcome one of
``passed``, ``skipped``, ``refused``, ``failed``; the message is the refusal's or the failure's
first line. A test is ``refused`` when it fails on a
``NotImplementedError`` or ``ValueError`` raised inside mla whose message names one of the
refusals docs/hf.md lists (its table "What is refused, and what to do"); any other failure, an
mla error that names none of them included, is ``failed``.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NUM_BLOCKS, BLOCK_SIZE = 1024, 16       # 16k tokens: the tests' batches of 13 rows, beams and drafts
_RESULTS: dict = {}                     # "report": test id -> its outcome, in the process that writes it


def pytest_addoption(parser):
    group = parser.getgroup("mla")
    group.addoption("--mla-patch", action="store_true", help="run every MLA model the tests build on mla.hf.patch")
    group.addoption("--mla-report", default=None, help="write one JSON line a test's outcome to this file")


def refusal_names(doc: Path = REPO / "docs" / "hf.md") -> tuple[str, ...]:
    """The backticked names of the "Message names" column of docs/hf.md's refusal table."""
    text = doc.read_text()
    table = text.split("## What is refused, and what to do", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in table.splitlines():
        cells = line.split("|")
        if len(cells) > 3 and not set(cells[2].strip()) <= set("- "):
            names += re.findall(r"`([^`]+)`", cells[2])
    return tuple(names)


def _patch_every_mla_model(num_blocks: int, block_size: int) -> None:
    import mla
    from transformers import PreTrainedModel
    from transformers.generation.utils import GenerationMixin
    from mla.hf.patch import _is_mla_attention, _MLAAttention

    def ensure_patched(model) -> bool:
        """Patch ``model`` if it is an unpatched top-level MLA model; True when it patched now."""
        if "_mla_suite_handle" in vars(model):
            return False
        modules = list(model.modules())
        if not any(_is_mla_attention(m) for m in modules) or any(isinstance(m, _MLAAttention) for m in modules):
            return False          # another family, or an inner model already running on stand-ins
        vars(model)["_mla_suite_handle"] = mla.hf.patch(model, num_blocks=num_blocks, block_size=block_size)
        return True

    call, generate = PreTrainedModel.__call__, GenerationMixin.generate

    def patched_call(self, *args, **kwargs):
        ensure_patched(self)
        return call(self, *args, **kwargs)

    def patched_generate(self, *args, **kwargs):
        if ensure_patched(self):  # the patch's own generate (an instance attribute) from now on
            return self.generate(*args, **kwargs)
        return generate(self, *args, **kwargs)

    PreTrainedModel.__call__ = patched_call
    GenerationMixin.generate = patched_generate


def pytest_configure(config):
    if config.getoption("--mla-patch"):
        _patch_every_mla_model(NUM_BLOCKS, BLOCK_SIZE)
    config._mla_names = refusal_names()
    # the outcomes gather where the reports arrive: the controller under xdist, not its workers
    if config.getoption("--mla-report") and not hasattr(config, "workerinput"):
        _RESULTS["report"] = {}


def _mla_error(excinfo) -> BaseException | None:
    """The NotImplementedError / ValueError raised inside mla that the failure ends in, or None."""
    src = str(REPO / "src" / "mla") + os.sep
    err, seen = excinfo.value, set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        tb, last = err.__traceback__, None
        while tb is not None:
            last, tb = tb, tb.tb_next
        if (isinstance(err, (NotImplementedError, ValueError)) and last is not None
                and last.tb_frame.f_code.co_filename.startswith(src)):
            return err
        err = err.__cause__ or err.__context__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and report.failed:
        err = _mla_error(call.excinfo)
        message = _first_line(err) if err is not None else ""
        if err is not None and any(name in message for name in item.config._mla_names):
            report.user_properties.append(("mla_refusal", message))
        else:
            entry = call.excinfo.traceback[-1]
            report.user_properties.append(("mla_error", f"{_first_line(call.excinfo.value)} "
                                                        f"({Path(str(entry.path)).name}:{entry.lineno + 1})"))


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"[:300]


def pytest_runtest_logreport(report):
    results = _RESULTS.get("report")
    if results is None:
        return
    props = dict(report.user_properties)
    entry = results.setdefault(report.nodeid, {"outcome": "passed", "message": None})
    if report.failed:
        if entry["outcome"] != "failed":      # one failure that is not a refusal decides the test
            refused = "mla_refusal" in props
            entry["outcome"] = "refused" if refused else "failed"
            entry["message"] = props.get("mla_refusal" if refused else "mla_error")
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session):
    results, path = _RESULTS.get("report"), session.config.getoption("--mla-report")
    if results is None:
        return
    with open(path, "w") as f:
        for test, entry in sorted(results.items()):
            f.write(json.dumps({"test": test, **entry}) + "\n")
