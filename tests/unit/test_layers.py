"""The layer order of docs/architecture.md, enforced on the source: no import circle between modules of
``src/tensorwire`` and no import from a higher layer into a lower one.

Imports are read with ``ast`` (nothing is imported): module-level ones, those inside functions and those under
``if TYPE_CHECKING:`` alike, since a lazy import that goes upward is still an upward dependency, and two modules
that name each other's types only for a checker still use each other's insides. ``from package import name``
depends on ``package.name`` when that is a module.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "src"

# Bottom to top, as docs/architecture.md draws them. A module may import from its own layer and the ones
# listed before it. Every module must match exactly one layer: a new module is placed here on purpose.
LAYERS: list[tuple[str, list[str]]] = [
    ("errors", ["tensorwire.errors"]),
    ("values and the environment", ["tensorwire.config", "tensorwire.lifetime", "tensorwire.descriptors",
                                    "tensorwire.cuda", "tensorwire.deadlines", "tensorwire.environment",
                                    "tensorwire.sealing", "tensorwire.network", "tensorwire.shared_memory"]),
    ("meeting", ["tensorwire.meeting", "tensorwire.meeting.*"]),
    ("memory maps and waiting", ["tensorwire.memory_map", "tensorwire.progress"]),
    ("backends", ["tensorwire.backends", "tensorwire.backends.*"]),
    ("communicator", ["tensorwire.communicator", "tensorwire.registration", "tensorwire.transfer",
                      "tensorwire.blocks", "tensorwire.block_transfer", "tensorwire.revocation", "tensorwire.runtime",
                      "tensorwire.notifications", "tensorwire.outbox", "tensorwire.stream_completion",
                      "tensorwire.transfer_state", "tensorwire.peers", "tensorwire.arguments", "tensorwire.freshness",
                      "tensorwire.local_memory", "tensorwire.joining"]),
    ("moe", ["tensorwire.moe", "tensorwire.moe.*"]),
    ("launcher and test data", ["tensorwire.testing", "tensorwire.testing.launch", "tensorwire.testing.data",
                                "tensorwire.testing.netns"]),
    ("public API", ["tensorwire"]),
    ("kv", ["tensorwire.kv", "tensorwire.kv.*"]),
    ("integrations", ["tensorwire.integrations", "tensorwire.integrations.*"]),
    ("tool support", ["tensorwire.machine", "tensorwire.testing.suite", "tensorwire.testing.scenarios",
                      "tensorwire.testing.moe_reference", "tensorwire.testing.cli_run",
                      "tensorwire.testing.kv_pools"]),
    ("tools", ["tensorwire.doctor", "tensorwire.doctor_probe", "tensorwire.ucx_protocols", "tensorwire.bench",
               "tensorwire.bench.*"]),
    ("command", ["tensorwire.cli", "tensorwire.__main__"]),
]

# The layers above the communicator (MoE engines, benchmarks, testing helpers) use its public calls and the seam of
# ``comm.runtime`` (store, channels, transports, close_with, extension slots); handles get a Runtime or a callback.
# Nothing reaches a private attribute of a communicator, seen as ``<name>._attr`` or ``<name>.__dict__`` where the
# name is comm, _comm, communicator or _communicator (``self.comm`` included).
_COMMUNICATOR_NAMES = {"comm", "_comm", "communicator", "_communicator"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (path, is a package)}`` for every module under src/tensorwire."""
    modules = {}
    for path in sorted((SOURCE / "tensorwire").rglob("*.py")):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, type_checking: bool = True):
    """Every import statement, at any depth; those under ``if TYPE_CHECKING:`` only with ``type_checking``."""
    pending = [tree]
    while pending:
        node = pending.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                pending.extend(child.orelse)
            elif isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child
            else:
                pending.append(child)


def _graph(type_checking: bool = True) -> dict[str, set[str]]:
    """``{module: the tensorwire modules it imports}`` (``TYPE_CHECKING`` imports included unless told)."""
    modules = _modules()
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _import_nodes(ast.parse(path.read_text(), str(path)), type_checking):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name in modules)
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module
            if origin in modules:
                targets.update(f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names)
        graph[name] = targets - {name}
    return graph


def _layer_of(module: str) -> list[int]:
    return [i for i, (_, patterns) in enumerate(LAYERS) if any(fnmatch.fnmatchcase(module, p) for p in patterns)]


def _circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return _graph()


def test_every_module_sits_in_exactly_one_layer(graph):
    misplaced = {m: [LAYERS[i][0] for i in _layer_of(m)] for m in graph if len(_layer_of(m)) != 1}
    assert not misplaced, f"place each module in exactly one layer of LAYERS (and docs/architecture.md): {misplaced}"


def test_nothing_imports_from_a_higher_layer(graph):
    upward = [f"{m} ({LAYERS[_layer_of(m)[0]][0]}) imports {t} ({LAYERS[_layer_of(t)[0]][0]})"
              for m, targets in sorted(graph.items()) for t in sorted(targets)
              if len(_layer_of(m)) == 1 and len(_layer_of(t)) == 1 and _layer_of(t)[0] > _layer_of(m)[0]]
    assert not upward, "imports against the layer order of docs/architecture.md:\n" + "\n".join(upward)


def test_no_import_circle(graph):
    circles = [sorted(c) for c in _circles(graph)]
    assert not circles, (f"import circles (TYPE_CHECKING imports count): {circles}; break them (a module imported by "
                         "both, a Protocol for what one needs of the other; a lazy import will not do)")


def test_the_graph_counts_type_checking_imports(graph):
    # stream_completion.py names the Runtime only for a checker.
    assert "tensorwire.runtime" in graph["tensorwire.stream_completion"]
    assert "tensorwire.runtime" not in _graph(type_checking=False)["tensorwire.stream_completion"]
    assert _circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [frozenset({"a", "b"})]


def test_doctor_and_the_benchmarks_do_not_import_each_other(graph):
    bench = {m for m in graph if m == "tensorwire.bench" or m.startswith("tensorwire.bench.")}
    assert not graph["tensorwire.doctor"] & bench, "doctor imports bench: shared code belongs in machine/testing"
    assert not any("tensorwire.doctor" in graph[m] for m in bench), "bench imports doctor: use tensorwire.machine"
    assert not any("tensorwire.cli" in graph[m] for m in graph if m != "tensorwire.__main__"), "only __main__ runs cli"


def _private_reaches(holders: set[str], owner: str) -> dict[str, set[str]]:
    """Per module (``owner`` itself left out): the private attributes (and ``__dict__``) read through a name in
    ``holders``."""
    reaches: dict[str, set[str]] = {}
    for name, (path, _) in _modules().items():
        found = _reaches_in(ast.parse(path.read_text(), str(path)), holders)
        if found and name != owner:
            reaches[name] = found
    return reaches


def _reaches_in(tree: ast.AST, holders: set[str]) -> set[str]:
    """The private attributes (and ``__dict__``) of ``tree`` read through a name in ``holders``."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if not (node.attr == "__dict__" or (node.attr.startswith("_") and not node.attr.startswith("__"))):
            continue
        holder = node.value
        held_by = holder.id if isinstance(holder, ast.Name) else getattr(holder, "attr", None)
        if held_by in holders:
            found.add(node.attr)
    return found


def test_no_module_reaches_into_the_communicator():
    reaches = _private_reaches(_COMMUNICATOR_NAMES, "tensorwire.communicator")
    assert not reaches, (f"private attributes of the Communicator used elsewhere: {reaches}; use comm.runtime (the "
                         "seam: store, channel, transports, close_with, extension) or give it a public method")


def test_the_reach_check_sees_a_reach():
    source = ("def f(comm, engine):\n    comm.__dict__.setdefault('x', 1)\n    engine.comm._inbox.pump()\n"
              "    return comm._backends, comm.runtime.store, comm.__class__\n")
    assert _reaches_in(ast.parse(source), _COMMUNICATOR_NAMES) == {"__dict__", "_inbox", "_backends"}


# A transfer's companions (stream completion, block transfers, revocation, the communicator) act on it through
# its methods and its TransferState, never through its private attributes. Seen as ``<name>._attr`` where the
# name is one they call a transfer by.
_TRANSFER_NAMES = {"owner", "_owner", "core", "_core", "transfer", "_transfer"}


def test_integrations_and_kv_use_the_public_api_only(graph):
    """``tensorwire.kv`` imports ``tensorwire`` itself and its own modules, an integration those and
    ``tensorwire.kv``, nothing else of tensorwire; and no module below an integration imports one (``import
    tensorwire`` must never import a serving engine)."""
    integrations = {m for m in graph if m.startswith("tensorwire.integrations")}
    kv = {m for m in graph if m == "tensorwire.kv" or m.startswith("tensorwire.kv.")}
    private = {m: sorted(t for t in graph[m] if t != "tensorwire" and t not in integrations | kv)
               for m in integrations | kv}
    assert not any(private.values()), f"integrations or kv reaching below the public API: {private}"
    assert not any(graph[m] & integrations for m in kv), "tensorwire.kv imports an engine adapter"
    for name, (path, _) in _modules().items():
        if name in integrations | kv:
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tw":
                    assert not node.attr.startswith("_"), f"{name} uses tw.{node.attr}, a private name"
    tools = {m for m in graph if m.startswith(("tensorwire.bench", "tensorwire.cli", "tensorwire.__main__"))}
    importers = {m for m in graph if graph[m] & integrations} - integrations - tools
    assert not importers, f"{sorted(importers)} import an integration (and so a serving engine)"


def test_no_module_reaches_into_a_transfer():
    reaches = _private_reaches(_TRANSFER_NAMES, "tensorwire.transfer")
    assert not reaches, f"private attributes of a Transfer used elsewhere: {reaches}; give it a method"
