"""MkDocs hook (mkdocs.yml `hooks:`): the tutorial notebooks as pages of the site.

The notebooks live in notebooks/, outside docs_dir, where nbval runs them and Binder
opens them. Each notebooks/NN_name.ipynb becomes the page tutorials/NN_name.ipynb, read
in place (nothing is copied into docs/), before mkdocs-jupyter renders it with its saved
outputs (execute: false).

A notebook's own relative links are written for notebooks/ (`01_transfers.ipynb`,
`../docs/panel.png`): in the rendered page they are pointed at the pages and files of
the site, and one that leads to nothing in the site is a warning (so `--strict` fails).
"""
from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.notebooks")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
DOCS = ROOT / "docs"
PREFIX = "tutorials/"
LINK = re.compile(r'(href|src)="([^"#?:]+)((?:#[^"]*)?)"')


@event_priority(100)   # before mkdocs-jupyter's on_files, which wraps .ipynb pages
def on_files(files, config):
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        files.append(File.generated(config, PREFIX + path.name, abs_src_path=str(path)))
    return files


def on_nav(nav, config, files):
    """mkdocs-jupyter wraps each page's File; its wrapper works out abs_src_path from
    src_dir, which a generated File has not: give it the notebook's path again."""
    for file in files:
        if file.src_uri.startswith(PREFIX) and file.src_uri.endswith(".ipynb"):
            file.__dict__["abs_src_path"] = str(NOTEBOOKS / file.src_uri[len(PREFIX):])
    return nav


def _site_uri(target: str) -> str | None:
    """The src_uri in the site of a link written relative to notebooks/."""
    real = (NOTEBOOKS / target).resolve()
    if real.parent == NOTEBOOKS and real.suffix == ".ipynb":
        return PREFIX + real.name
    if DOCS in real.parents:
        return real.relative_to(DOCS).as_posix()
    return None


def on_page_content(html, page, config, files):
    if not (page.file.src_uri.startswith(PREFIX) and page.file.src_uri.endswith(".ipynb")):
        return html

    def relink(match):
        kind, target, anchor = match.groups()
        if target.startswith(("/", "data")) or not target.strip():
            return match.group(0)
        uri = _site_uri(target)
        found = files.get_file_from_path(uri) if uri else None
        if found is None:
            log.warning("%s links to '%s', which is not in the site", page.file.src_uri, target)
            return match.group(0)
        return f'{kind}="{found.url_relative_to(page.file)}{anchor}"'

    return LINK.sub(relink, html)
