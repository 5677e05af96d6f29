"""A griffe extension for the API reference (mkdocs.yml: mkdocstrings' python handler).

- Doctest lines in a docstring (`>>> ...`, `... ...` and the output after them, up to a
  blank line) become a ```pycon block; Markdown would otherwise read them as quotes.
- TrainConfig's fields are declared as `name: type = setting(default, kind, group, help,
  ...)` (config.py): the reference shows each field with its default as its value and
  its help line as its docstring, the same text `%%fasttrain?` and the panel show.
- A `<placeholder>` outside backticks is shown as text, not swallowed as an HTML tag.
"""
from __future__ import annotations

import ast
import re

import griffe


def fence_doctests(text: str) -> str:
    out, block, in_fence = [], [], False
    for line in text.splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("```"):
            in_fence = not in_fence
        if not in_fence and (stripped.startswith(">>>") or (block and stripped)):
            block.append(line.strip())
            continue
        if block:
            out += ["```pycon", *block, "```"]
            block = []
        out.append(line)
    return "\n".join(out).rstrip("\n")


CODE_SPAN = re.compile(r"(`[^`]*`)")
TAG_LIKE = re.compile(r"<(\w[\w-]*)>")


def escape_placeholders(text: str) -> str:
    """`<file>.nbtrain-index` written outside backticks is a placeholder, not HTML."""
    out, in_fence = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
        if not in_fence:
            line = "".join(part if part.startswith("`") else TAG_LIKE.sub(r"&lt;\1&gt;", part)
                           for part in CODE_SPAN.split(line))
        out.append(line)
    return "\n".join(out)


def _setting_call(node) -> ast.Call | None:
    value = getattr(node, "value", None)
    if (isinstance(node, ast.AnnAssign) and isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name) and value.func.id == "setting"):
        return value
    return None


class NbtrainDocs(griffe.Extension):
    def on_attribute_instance(self, *, node, attr, agent, **kwargs) -> None:
        call = _setting_call(node)
        if call is None or attr.parent is None or attr.parent.name != "TrainConfig":
            return
        default, help_node = call.args[0], (call.args[3] if len(call.args) > 3 else None)
        attr.value = ast.unparse(default)
        if help_node is not None:
            try:
                text = ast.literal_eval(help_node)
            except ValueError:
                text = ast.unparse(help_node)
            attr.docstring = griffe.Docstring(str(text), parent=attr)

    def on_object(self, *, obj, loader, **kwargs) -> None:
        if obj.docstring is None:
            return
        if ">>>" in obj.docstring.value:
            obj.docstring.value = fence_doctests(obj.docstring.value)
        obj.docstring.value = escape_placeholders(obj.docstring.value)
