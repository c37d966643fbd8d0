"""Griffe extension for the API reference: show Sphinx roles in docstrings as plain code.

The package's docstrings are Google style, with a few Sphinx cross-reference roles (``:class:`~a.b.C```,
``:meth:`add```) that Markdown would print literally. Here each becomes a code span (`` `C` ``, `` `add` ``); the
source files are left as they are.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring once the object tree is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_code, obj.docstring.value)
