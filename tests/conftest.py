import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*litlogger.*")

if os.environ.get("PYTEST_XDIST_WORKER"):  # one process per core: each keeps to one thread, or they contend
    import torch

    torch.set_num_threads(1)

import pytest  # noqa: E402

#: The time model's speeds every test plans with: those measured on one thread of this project's CI machine
#: (2026-12-02), so that what the planner chooses does not depend on the load of the machine the tests run on.
#: ``tests/test_timing.py`` measures the real ones.
PINNED = dict(flop_s=6.0e-12, byte_s=4.0e-11, op_s=6.5e-6, policy_op_s=1.5e-5, call_s=1.4e-4)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup`` (pyproject.toml), a worker of pytest-xdist names each test marked
    ``xdist_group(name)`` ``<node id>@<name>``, which its scheduler reads to send a group's tests to one worker. xdist
    3.8 sets the node id as a string, which pytest 9.2 no longer reads (it keeps a ``NodeId``): the tests of a group
    went to either worker, each computing the runs they share. The name is set here where xdist's did not take."""
    if not getattr(config.option, "loadgroup", False):  # only a worker under --dist loadgroup has it set
        return
    from _pytest.nodeid import NodeId

    for item in items:
        marks = item.iter_markers("xdist_group")
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
        suffix = f"@{'_'.join(names)}"
        if names and not item.nodeid.endswith(suffix):
            item._id = NodeId.parse(item.nodeid + suffix)


@pytest.fixture(autouse=True)
def pinned_speeds(monkeypatch):
    import torch

    from lightning_memopt import timing

    pinned = {timing._key(torch.device("cpu"), n): timing.Speed("cpu", **PINNED) for n in range(1, 65)}
    monkeypatch.setattr(timing, "_MEASURED", pinned)
    monkeypatch.setenv("LIGHTNING_MEMOPT_CACHE_DIR", "")  # and none from a file, nor kept in one
    monkeypatch.setenv("LIGHTNING_MEMOPT_STRICT", "1")  # a dry run that MemOpt's own stand-in broke fails the test
    monkeypatch.setattr(timing, "_UNSEEN", {})  # nothing a real step took beyond its dry run carried between tests
    yield pinned
