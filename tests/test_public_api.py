"""The public API is what the public modules' ``__all__`` export, and docs/usage.md's "Public
names" lists exactly that; a renamed public name still works under its old name for a release,
warning with the new one."""

from __future__ import annotations

import importlib
import re
import threading
from pathlib import Path

import pytest
from helpers import Tiers, assert_state_equal, blank_like, clone_state
from helpers.fakes import HeldSettles
from helpers.tiers import make_state

from dcp_datastates import CheckpointManager, Engine
from dcp_datastates._renamed import Renamed

ROOT = Path(__file__).resolve().parents[1]
#: The modules whose ``__all__`` is public (docs/usage.md, "Public names").
PUBLIC_MODULES = ["dcp_datastates", "dcp_datastates.tiers",
                  "dcp_datastates.integrations.torchtitan"]
#: Internal names the docs mention, and why.
DOCUMENTED_INTERNALS = {
    "dcp_datastates.errors": "where the exceptions live; dcp_datastates exports every one",
    "dcp_datastates._io.IOBackend": "the protocol of an io_backend= object (a test seam)",
    "dcp_datastates.format.metadata_file": "where .metadata names what it pickles (the format)",
}


def _section(title: str) -> str:
    text = (ROOT / "docs" / "usage.md").read_text()
    return text.split(f"\n{title}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]


def _listed() -> dict[str, set[str]]:
    """The names "Public names" lists, by module (a bold module heading, then a table)."""
    parts = re.split(r"^\*\*`([\w.]+)`\*\*.*$", _section("## Public names"), flags=re.M)
    return {module: set(re.findall(r"^\| `(\w+)` \|", rows, re.M))
            for module, rows in zip(parts[1::2], parts[2::2], strict=True)}


def _exported(module: str) -> set[str]:
    return set(importlib.import_module(module).__all__)


def test_usage_lists_exactly_what_the_public_modules_export() -> None:
    assert _listed() == {m: _exported(m) for m in PUBLIC_MODULES}


def test_every_exported_name_exists() -> None:
    for module in PUBLIC_MODULES:
        loaded = importlib.import_module(module)
        for name in _exported(module):
            try:
                getattr(loaded, name)
            except ImportError:  # torchtitan not installed: the error says to install it
                assert (module, name) == ("dcp_datastates.integrations.torchtitan",
                                          "DataStatesCheckpointManager")


def test_the_docs_name_no_internal_module_or_name() -> None:
    """Every ``from dcp_datastates... import`` and ``dcp_datastates.<name>`` in README.md and
    docs/ names a public module or a name one exports (or one of DOCUMENTED_INTERNALS)."""
    public = set(PUBLIC_MODULES) | {f"{m}.{n}" for m in PUBLIC_MODULES for n in _exported(m)}
    found = set()
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        if path.name == "ARCHITECTURE.md":  # the map of the internal modules
            continue
        text = path.read_text()
        found |= set(re.findall(r"(?<![\w.])(dcp_datastates(?:\.\w+)+)", text))
        for module, names in re.findall(r"from (dcp_datastates[\w.]*) import ([\w, ]+)", text):
            found |= {module} | {f"{module}.{n.strip()}" for n in names.split(",")}
    assert sorted(found - public - set(DOCUMENTED_INTERNALS)) == []


#: The example files that import a private module, and why.
PRIVATE_IMPORTS_IN_EXAMPLES = {
    "torchtitan_resume.py": "the resume check reads which steps each rank's memory tier and "
                            "its replicas hold (tiers._steps, tiers._replica) without a manager",
}


def _private_imports(text: str) -> set[str]:
    """The private modules (a part named ``_...``) that ``text``'s imports name."""
    found = set()
    for module, names in re.findall(r"^\s*from (dcp_datastates[\w.]*) import \(?([\w, ]+)",
                                    text, re.M):
        found |= {module} | {f"{module}.{n.split(' as ')[0].strip()}" for n in names.split(",")}
    found |= set(re.findall(r"^\s*import (dcp_datastates[\w.]*)", text, re.M))
    found |= set(re.findall(r"import_module\([\"'](dcp_datastates[\w.]*)", text))
    return {m for m in found if any(p.startswith("_") for p in m.split(".")[1:])}


def test_the_docs_and_examples_import_no_private_module() -> None:
    """Tests import private modules (``dcp_datastates._format...``, ``tiers._slots``): the one
    test seam; README.md, docs/ and examples/ import only what ``__all__`` exports."""
    assert _private_imports("from dcp_datastates import Engine, _cli as cli\n"
                            "import dcp_datastates.tiers._slots\n") == {
        "dcp_datastates._cli", "dcp_datastates.tiers._slots"}
    found = {}
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                 *(ROOT / "examples").glob("*.py")]:
        if path.name not in PRIVATE_IMPORTS_IN_EXAMPLES and _private_imports(path.read_text()):
            found[path.relative_to(ROOT).as_posix()] = sorted(_private_imports(path.read_text()))
    assert found == {}
    for name in PRIVATE_IMPORTS_IN_EXAMPLES:  # an exception that is no longer needed goes
        assert _private_imports((ROOT / "examples" / name).read_text()), name


# -- renamed names ---------------------------------------------------------------------------------
def _aliases() -> dict[str, str]:
    """Every old name the public classes keep: ``Class.old`` -> ``Class.new (goes in X)``."""
    out = {}
    for module in PUBLIC_MODULES:
        for name in _exported(module):
            try:
                cls = getattr(importlib.import_module(module), name, None)
            except ImportError:  # needs torchtitan, not installed (test_every_exported_name_exists)
                continue
            for old, attr in vars(cls).items() if isinstance(cls, type) else ():
                if isinstance(attr, Renamed):
                    out[f"{name}.{old}"] = f"{name}.{attr.new} (goes in {attr.removed_in})"
    return out


def test_usage_lists_every_deprecated_name() -> None:
    rows = re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \| ([\d.]+) \|", _section(
        "### Deprecated names"), re.M)
    assert {old: f"{new} (goes in {version})" for old, new, version in rows} == _aliases()


@pytest.mark.parametrize("name, renamed_to", [
    ("wait_for_staging", None), ("wait_for_snapshots", "wait_for_staging"),
    ("order_after_staging", None), ("order_after_snapshots", "order_after_staging")])
def test_an_old_name_warns_and_waits_as_the_new_one(
        tiers: Tiers, held: HeldSettles, name: str, renamed_to: str | None) -> None:
    """The manager's waits, by either name: ``wait_for_staging`` blocks while a save's
    snapshot is still being handed out (``order_after_staging`` only until its copies are over:
    on the CPU, before ``save()`` returns), and after either the state changed in place leaves
    the checkpoint as it was at the save. The old name warns, naming the new one."""
    engine = Engine(host_cache_size="8MiB", io_backend="threads", io_workers=2,
                    settle_pool=held)
    state, expected = make_state(1), clone_state(make_state(1))
    with CheckpointManager(memory_dir=tiers.memory, persist=None, engine=engine) as manager:
        manager.prepare(state, wait=True)
        handle = manager.save(1, state)
        if renamed_to is None:
            wait = getattr(manager, name)
        else:
            with pytest.warns(DeprecationWarning, match=rf"CheckpointManager\.{name} is "
                              rf"deprecated: it was renamed CheckpointManager\.{renamed_to}"):
                wait = getattr(manager, name)
        waiter = threading.Thread(target=wait)
        waiter.start()
        waiter.join(0.3)
        if (renamed_to or name) == "wait_for_staging":
            assert waiter.is_alive(), f"{name}() returned while the snapshot was handed out"
        held.gate.set()
        waiter.join(60)
        assert not waiter.is_alive()
        state["model"]["w"].fill_(7.0)  # training goes on after the wait
        handle.result(timeout=60)
        out = blank_like(expected)
        assert manager.load(out, step=1) == 1
    assert_state_equal(out, expected)
    engine.close()

