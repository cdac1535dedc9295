"""[Note: moved code] in tidal/testing/moves.py: which changes only moved code, on made-up
packages read from dicts."""

from __future__ import annotations

import textwrap

from tidal.testing.moves import only_moved

A = '''\
"""Module a."""
import math

from pkg.base import helper

__all__ = ["area", "SCALE"]

SCALE = 2.0


def area(r):
    """The area."""
    return SCALE * math.pi * helper(r) ** 2


def perimeter(r):
    return 2 * math.pi * r
'''
BASE = "def helper(x):\n    return x + 1\n"
USER = "from pkg.a import area\n\n\ndef use():\n    return area(1)\n"


def _source(files: dict[str, str]):  # noqa: ANN202 - a Source
    return lambda path: files.get(path)


def _moved(before: dict[str, str], after: dict[str, str], *, importers=("pkg/user.py",)) -> bool:
    files = sorted({p for p in before | after if before.get(p) != after.get(p)})
    shared = {"pkg/base.py": BASE, "pkg/user.py": USER, "pkg/__init__.py": ""}
    return only_moved(files, before=_source({**shared, **before}),
                      now=_source({**shared, **after}), importers=list(importers))  # fmt: skip


def _dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip()


BEFORE = {"pkg/a.py": A}
# area and SCALE carried to pkg/shapes.py; a re-exports area for its importers
SHAPES = _dedent('''
    import math

    from pkg.base import helper

    SCALE = 2.0


    def area(r):
        """Docstrings may differ."""
        return SCALE * math.pi * helper(r) ** 2
''')
A_LEFT = _dedent("""
    import math

    from pkg.shapes import area


    def perimeter(r):
        return 2 * math.pi * r
""")


def test_definitions_carried_to_a_new_file_with_their_imports_only_moved() -> None:
    assert _moved(BEFORE, {"pkg/a.py": A_LEFT, "pkg/shapes.py": SHAPES})


def test_an_edit_beside_a_move_is_a_change() -> None:
    edited = SHAPES.replace("** 2", "** 3")
    assert not _moved(BEFORE, {"pkg/a.py": A_LEFT, "pkg/shapes.py": edited})
    copied = A_LEFT + "\n\nSCALE = 2.0\n"  # a copy left behind is not a move either
    assert not _moved(BEFORE, {"pkg/a.py": copied, "pkg/shapes.py": SHAPES})


def test_a_name_that_means_something_else_where_the_code_now_stands_is_a_change() -> None:
    other_helper = SHAPES.replace("from pkg.base import helper", "from math import floor as helper")
    assert not _moved(BEFORE, {"pkg/a.py": A_LEFT, "pkg/shapes.py": other_helper})
    other_math = SHAPES.replace("import math", "import cmath as math")
    assert not _moved(BEFORE, {"pkg/a.py": A_LEFT, "pkg/shapes.py": other_math})
    named = A.replace("return 2 * math.pi * r", "return __name__")
    moved_named = _dedent("""
        import math


        def perimeter(r):
            return __name__
    """)
    left = named.replace(named[named.index("def perimeter") :], "")
    assert not _moved({"pkg/a.py": named}, {"pkg/a.py": left, "pkg/p.py": moved_named})
    plain = moved_named.replace("return __name__", "return 2 * math.pi * r")
    assert _moved(BEFORE, {"pkg/a.py": A.replace(A[A.index("def perimeter") :], ""),
                           "pkg/p.py": plain}), "the same move without __name__ is one"  # fmt: skip


def test_a_move_into_a_module_without_the_same_future_imports_is_a_change() -> None:
    future = "from __future__ import annotations\n\n"
    before = {"pkg/a.py": A.replace("import math\n", future + "import math\n", 1)}
    after = {"pkg/a.py": future + A_LEFT, "pkg/shapes.py": SHAPES}
    assert not _moved(before, after)
    assert _moved(before, {**after, "pkg/shapes.py": future + SHAPES})


def test_a_function_that_rebinds_a_global_cannot_move() -> None:
    counter = "COUNT = 0\n\n\ndef bump():\n    global COUNT\n    COUNT += 1\n"
    left = "COUNT = 0\n"
    moved = "from pkg.c import COUNT\n\n\ndef bump():\n    global COUNT\n    COUNT += 1\n"
    assert not _moved({"pkg/c.py": counter}, {"pkg/c.py": left, "pkg/d.py": moved}, importers=())
    kept = counter + "\n\ndef other():\n    return 1\n"
    assert _moved(
        {"pkg/c.py": kept},
        {"pkg/c.py": counter, "pkg/d.py": "def other():\n    return 1\n"},
        importers=(),
    ), "a global-rebinding function that stays put does not stop a move"


def test_an_importer_that_no_longer_reaches_the_same_definition_is_a_change() -> None:
    no_reexport = A_LEFT.replace("from pkg.shapes import area\n", "")
    assert not _moved(BEFORE, {"pkg/a.py": no_reexport, "pkg/shapes.py": SHAPES})
    assert _moved(BEFORE, {"pkg/a.py": no_reexport, "pkg/shapes.py": SHAPES}, importers=())
    # two definitions that swap files: the same statements, but the importer gets the other
    one, two = "def f():\n    return 1\n", "def f():\n    return 2\n"
    swap_before = {"pkg/a.py": one, "pkg/b.py": two}
    swap_after = {"pkg/a.py": two, "pkg/b.py": one}
    user = "from pkg.a import f\n"
    assert not only_moved(["pkg/a.py", "pkg/b.py"], before=_source({**swap_before, "pkg/u.py": user}),
                          now=_source({**swap_after, "pkg/u.py": user}), importers=["pkg/u.py"])  # fmt: skip


def test_a_method_taken_out_of_its_class_is_a_change() -> None:
    before = (
        "class C:\n    def f(self):\n        return g(self)\n\n    def h(self):\n        return 1\n"
    )
    after = "class C:\n    def f(self):\n        return g(self)\n\n\ndef h(self):\n    return 1\n"
    assert not _moved({"pkg/c.py": before}, {"pkg/c.py": after}, importers=())


def test_a_file_with_a_relative_import_or_a_file_not_python_is_a_change() -> None:
    relative = A_LEFT.replace("from pkg.shapes import area", "from .shapes import area")
    assert not _moved(BEFORE, {"pkg/a.py": relative, "pkg/shapes.py": SHAPES})
    assert not only_moved(["pkg/data.json"], before=_source({}), now=_source({}), importers=())
