"""Whether a change only moved code between files, for the claims check's staleness test
([Note: claims] in claims.py): a file past the project's 600 lines can then be split without
making every figure of its bench stale.

[Note: moved code]
A change to some files *only moved code* when all three hold:

1. The files' top-level statements other than imports (functions, classes, constants, any
   statement run at import; docstrings left out, as the claims check leaves them out), taken
   together, are the same multiset before and after: nothing was edited, added, copied or
   dropped, only carried from one file to another. ``__all__`` and ``if TYPE_CHECKING:`` blocks
   are left out: they do nothing when the code runs.
2. Every name such a statement reads means what it meant where the statement stood before:
   resolved through its module's definitions and imports, and followed through the
   repository's modules to the statement that defines it, both resolutions end at the same
   statement (by content) or at the same name outside the repository (``torch.nn``).
   ``__name__`` and its kin name the module itself, so a statement that reads them cannot move,
   nor can a function with a ``global`` statement (it would rebind another module's name), and
   both modules turn on the same ``from __future__`` features (they change how code compiles).
3. Every ``from M import name`` in the bench's other files (its code the change left as it
   was) still reaches the same definition (a re-export moved with its definition, or two
   definitions swapped places, would otherwise go unseen).

Then every call runs the same statements on the same values, and what a bench measured of the
code before it would measure of the code after. Anything else (an edited line, a method moved
out of its class, a definition moved to a file outside the bench's code) is a change: the
figures are stale. Relative imports are not followed: a file that has one is a change. One gap
is accepted: a move changes the order in which statements run at
import, so a module-level registration whose order mattered would go unnoticed.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

__all__ = ["Source", "only_moved", "strip_docstrings"]

# The text of a repository path in one state of the code; None where the path does not exist.
Source = Callable[[str], str | None]

_MODULE_NAMES = frozenset({"__name__", "__file__", "__spec__", "__package__", "__path__",
                           "__loader__", "__doc__", "__builtins__"})  # fmt: skip
_MAX_HOPS = 16  # a chain of re-exports longer than this is resolved no further
Resolution = tuple[str, ...]


def strip_docstrings(tree: ast.AST) -> ast.AST:
    """``tree`` with the docstrings of its module, classes and functions left out (in place)."""
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):  # fmt: skip
            node.body = body[1:] or [ast.Pass()]
    return tree


def only_moved(files: Sequence[str], *, before: Source, now: Source,
               importers: Iterable[str]) -> bool:  # fmt: skip
    """Whether the change from ``before`` to ``now`` of ``files`` (repository paths, all the
    files whose code changed) only moved top-level statements between them ([Note: moved
    code]); ``importers``: the other files of the bench's code, the same in both states (read in
    ``now``), whose imports must still reach the same definitions."""
    if not files or not all(path.endswith(".py") for path in files):
        return False
    old, new = _State(before), _State(now)
    old_units, new_units = old.units(files), new.units(files)
    if old_units is None or new_units is None:
        return False
    if Counter(dump for dump, _, _ in old_units) != Counter(dump for dump, _, _ in new_units):
        return False
    where_before: dict[str, list[str]] = {}
    for dump, module, _ in old_units:
        where_before.setdefault(dump, []).append(module)
    for dump, module, statement in new_units:
        names = _names_read(statement)
        # a ``global`` statement rebinds a name of the module the code stands in
        stayed = [m for m in where_before[dump] if m == module] if _rebinds(statement) else None
        if not any(old.futures(was) == new.futures(module)
                   and all(old.resolve(was, n) == new.resolve(module, n) for n in names)
                   for was in (where_before[dump] if stayed is None else stayed)):  # fmt: skip
            return False
    changed = set(files)
    for path in importers:
        if path in changed or not path.endswith(".py"):
            continue
        text = now(path)
        if text is None:
            continue
        for origin, name in _imported(ast.parse(text)):
            if new.is_module(origin) and old.resolve(origin, name) != new.resolve(origin, name):
                return False
    return True


class _State:
    """One state of the repository's code, read through its ``Source``, parsed once a module."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self._trees: dict[str, ast.Module | None] = {}
        self._bindings: dict[str, dict[str, Resolution]] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            if not module or module.startswith("."):
                return None  # a relative import's: no module of the repository by that name
            base = module.replace(".", "/")
            text = self.source(f"{base}.py")
            text = text if text is not None else self.source(f"{base}/__init__.py")
            self._trees[module] = None if text is None else ast.parse(text)
        return self._trees[module]

    def is_module(self, module: str) -> bool:
        return self.tree(module) is not None

    def units(self, files: Iterable[str]) -> list[tuple[str, str, ast.stmt]] | None:
        """(content, module, statement) of each top-level statement of ``files`` that counts
        (rule 1 of [Note: moved code]); None if one of them imports relatively."""
        found = []
        for path in files:
            text = self.source(path)
            if text is None:
                continue
            tree = strip_docstrings(ast.parse(text))
            assert isinstance(tree, ast.Module)
            if any(isinstance(s, ast.ImportFrom) and s.level for s in ast.walk(tree)):
                return None
            for statement in tree.body:
                if not _does_nothing_at_run_time(statement):
                    found.append((ast.dump(statement), _module_of(path), statement))
        return found

    def resolve(self, module: str, name: str, hops: int = 0) -> Resolution:
        """What ``name`` means at the top level of ``module``: the statement that defines it,
        or the module or outside name it comes from."""
        if name in _MODULE_NAMES:
            return ("module attribute", module, name)
        binding = self.bindings(module).get(name)
        if binding is None:
            if self.is_module(f"{module}.{name}"):
                return ("module", f"{module}.{name}")
            return ("builtin", name) if self.is_module(module) else ("outside", module, name)
        if binding[0] != "from" or hops >= _MAX_HOPS:
            return binding
        origin, attr = binding[1], binding[2]
        if self.is_module(origin):
            return self.resolve(origin, attr, hops + 1)
        return ("outside", origin, attr)

    def futures(self, module: str) -> set[str]:
        """The ``from __future__`` features ``module`` turns on (they change how its code
        compiles: annotations left unevaluated, for one)."""
        return {name for name, found in self.bindings(module).items()
                if found[:2] == ("from", "__future__")}  # fmt: skip

    def bindings(self, module: str) -> dict[str, Resolution]:
        if module not in self._bindings:
            tree = self.tree(module)
            found: dict[str, Resolution] = {}
            if tree is not None:
                for statement in _top_level(tree.body):
                    found.update(_binds(statement))
            self._bindings[module] = found
        return self._bindings[module]


def _top_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """The statements run at import, into ``if`` and ``try`` blocks (imports made there bind
    names of the module too)."""
    for statement in body:
        yield statement
        if isinstance(statement, ast.If):
            yield from _top_level(statement.body + statement.orelse)
        elif isinstance(statement, ast.Try):
            blocks = statement.body + statement.orelse + statement.finalbody
            yield from _top_level(blocks + [s for h in statement.handlers for s in h.body])


def _binds(statement: ast.stmt) -> dict[str, Resolution]:
    """The names ``statement`` binds at the module's top level, and to what."""
    if isinstance(statement, ast.Import):
        return {
            alias.asname or alias.name.split(".")[0]:
            ("module", alias.name if alias.asname else alias.name.split(".")[0])
            for alias in statement.names
        }  # fmt: skip
    if isinstance(statement, ast.ImportFrom):
        origin = _origin(statement)
        return {alias.asname or alias.name: ("from", origin, alias.name)
                for alias in statement.names if alias.name != "*"}  # fmt: skip
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {statement.name: ("defined", ast.dump(strip_docstrings(statement)))}
    if isinstance(statement, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        return dict.fromkeys(names, ("defined", ast.dump(statement)))
    return {}


def _imported(tree: ast.Module) -> Iterable[tuple[str, str]]:
    for statement in _top_level(tree.body):
        if isinstance(statement, ast.ImportFrom):
            origin = _origin(statement)
            yield from ((origin, alias.name) for alias in statement.names if alias.name != "*")


def _origin(statement: ast.ImportFrom) -> str:
    """The module a ``from ... import`` reads; a relative one names no module of the
    repository, so it resolves to an outside name (files that have one are refused first)."""
    dots = "." * statement.level
    return f"{dots}{statement.module or ''}"


def _does_nothing_at_run_time(statement: ast.stmt) -> bool:
    if isinstance(statement, ast.Import | ast.ImportFrom):
        return True
    if isinstance(statement, ast.Assign | ast.AnnAssign):
        targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
        return all(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)
    return (isinstance(statement, ast.If) and isinstance(statement.test, ast.Name)
            and statement.test.id == "TYPE_CHECKING")  # fmt: skip


def _names_read(statement: ast.stmt) -> set[str]:
    """Every name ``statement`` reads (its own locals too: resolving a local finds it unbound
    at the top level in both states, unless a move brought a top-level name of that spelling
    beside it, and then the move is refused, which errs on the safe side)."""
    return {n.id for n in ast.walk(statement) if isinstance(n, ast.Name)}


def _rebinds(statement: ast.stmt) -> bool:
    return any(isinstance(node, ast.Global) for node in ast.walk(statement))


def _module_of(path: str) -> str:
    module = path.removesuffix(".py").replace("/", ".")
    return module.removesuffix(".__init__")
