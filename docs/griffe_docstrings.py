"""A griffe extension (mkdocs.yml, mkdocstrings ``extensions:``): two conventions of the package's
docstrings, read as the Google style that the reference renders.

1. An entry that describes several parameters at once, ``precision, rtol: as for Monitor.``,
   becomes one entry per name with the same text (griffe's Google parser takes one name an entry).
2. A reStructuredText simple table (columns framed by lines of ``=``) becomes a Markdown table.
3. A Sphinx cross-reference role (``:class:`~.base.ArrayFile```, ``:mod:`richness.cli.merge```)
   becomes the name in code.
4. A paragraph of ``name: text`` entries without a section title (``Report``'s fields, the
   ``M: ...`` of the finishing functions) becomes an ``Attributes:`` section (a class whose
   attributes they all are) or an ``Args:`` section (a function's or class's parameters), so
   that it renders as the table of a section rather than as text.

Only entries whose every name is a parameter or member of the object documented are touched;
the source is not changed, only what griffe parses.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, List, Set, Tuple

import griffe

ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|obj|exc):`~?\.?([^`]+)`")
BORDER = re.compile(r"^(?P<indent> *)=+( +=+)+ *$")
ENTRY = re.compile(r"^(?P<indent> *)(?P<names>[A-Za-z_]\w*(?:, [A-Za-z_]\w*)*): (?P<text>\S.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" ")) if line.strip() else -1


def _item_end(lines: List[str], i: int, indent: int) -> int:
    """The end (exclusive) of the entry at line ``i``: its lines indented past ``indent``, blank
    lines included when more of them follow."""
    j = i + 1
    while j < len(lines):
        if lines[j].strip():
            if _indent(lines[j]) <= indent:
                break
            j += 1
            continue
        k = j
        while k < len(lines) and not lines[k].strip():
            k += 1
        if k < len(lines) and _indent(lines[k]) > indent:
            j = k
            continue
        break
    return j


def _names(obj: Any) -> Tuple[Set[str], Set[str]]:
    """(parameters, members) of a function or class."""
    params: Set[str] = set()
    members: Set[str] = set()
    try:
        params = {p.name for p in obj.parameters}
    except Exception:  # a class without __init__, an alias that does not resolve
        pass
    if obj.is_class:
        try:
            members = set(obj.all_members)
        except Exception:
            members = set(obj.members)
    return params, members


def split_joint_entries(lines: List[str], known: Set[str]) -> List[str]:
    out: List[str] = []
    i = 0
    while i < len(lines):
        m = ENTRY.match(lines[i])
        names = m.group("names").split(", ") if m else []
        if len(names) > 1 and set(names) <= known:
            indent = len(m.group("indent"))
            end = _item_end(lines, i, indent)
            for name in names:
                out.append(f"{m.group('indent')}{name}: {m.group('text')}")
                out.extend(lines[i + 1:end])
            i = end
            continue
        out.append(lines[i])
        i += 1
    return out


def _runs(lines: List[str], known: Set[str]) -> Iterator[Tuple[int, int, Set[str]]]:
    """(start, end, names) of each paragraph of top-level ``name: text`` entries of known names."""
    i = 0
    while i < len(lines):
        m = ENTRY.match(lines[i])
        starts_paragraph = i == 0 or not lines[i - 1].strip()
        if m and not m.group("indent") and starts_paragraph and set(m.group("names").split(", ")) <= known:
            start, names = i, set()
            while i < len(lines):
                m = ENTRY.match(lines[i])
                if not (m and not m.group("indent") and set(m.group("names").split(", ")) <= known):
                    break
                names |= set(m.group("names").split(", "))
                i = _item_end(lines, i, 0)
                if i < len(lines) and not lines[i].strip():  # a blank line between two entries
                    k = i
                    while k < len(lines) and not lines[k].strip():
                        k += 1
                    nxt = ENTRY.match(lines[k]) if k < len(lines) else None
                    if nxt and not nxt.group("indent") and set(nxt.group("names").split(", ")) <= known:
                        i = k
            yield start, i, names
        else:
            i += 1


def _columns(border: str) -> List[Tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", border)]


def _cells(line: str, cols: List[Tuple[int, int]]) -> List[str]:
    """The text of each column of a table row (the last column runs to the end of the line)."""
    out = []
    for i, (start, _) in enumerate(cols):
        end = cols[i + 1][0] if i + 1 < len(cols) else len(line)
        out.append(line[start:end].strip())
    return out


def simple_tables(lines: List[str]) -> List[str]:
    """Each reST simple table (border, header, border, rows, border) as a Markdown table; a row
    whose first cell is empty continues the row above it."""
    out: List[str] = []
    i = 0
    while i < len(lines):
        m = BORDER.match(lines[i])
        borders = [j for j in range(i, len(lines)) if lines[j].strip() and BORDER.match(lines[j])][:3] if m else []
        if len(borders) < 3 or not all(lines[j].strip() for j in range(borders[0], borders[2] + 1)):
            out.append(lines[i])
            i += 1
            continue
        cols = _columns(lines[i])
        header = [_cells(line, cols) for line in lines[borders[0] + 1:borders[1]]]
        rows: List[List[str]] = []
        for line in lines[borders[1] + 1:borders[2]]:
            cells = _cells(line, cols)
            if rows and not cells[0]:
                rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
            else:
                rows.append(cells)
        head = [" ".join(c for c in col if c) for col in zip(*header)] if header else [""] * len(cols)
        indent = m.group("indent") if m else ""
        out.append(indent + "| " + " | ".join(head) + " |")
        out.append(indent + "|" + "---|" * len(cols))
        out.extend(indent + "| " + " | ".join(r) + " |" for r in rows)
        i = borders[2] + 1
    return out


def rewrite(text: str, obj: Any) -> str:
    text = ROLE.sub(r"``\1``", text)
    lines = simple_tables(text.splitlines())
    if obj.is_module:
        return "\n".join(lines)
    params, members = _names(obj)
    known = params | members
    if not known:
        return "\n".join(lines)
    lines = split_joint_entries(lines, known)
    for start, end, names in reversed(list(_runs(lines, known))):
        title = "Attributes:" if obj.is_class and names <= members else "Args:"
        block = [title] + [("    " + line) if line.strip() else "" for line in lines[start:end]]
        lines[start:end] = block
    return "\n".join(lines)


class PackageDocstrings(griffe.Extension):
    """Applies ``rewrite`` to every function's and class's docstring once the package is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        seen: Set[int] = set()

        def visit(obj: Any) -> None:
            if id(obj) in seen or obj.is_alias:
                return
            seen.add(id(obj))
            if (obj.is_module or obj.is_function or obj.is_class) and obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value, obj)
            if obj.is_module or obj.is_class:
                for member in list(obj.members.values()):
                    visit(member)

        visit(pkg)
