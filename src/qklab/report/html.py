"""report.html from the Markdown of report.md: rendered by markdown-it (CommonMark with tables) into one
self-contained page (inline CSS, the figures embedded as data URIs, nothing fetched from elsewhere)."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from markdown_it import MarkdownIt

STYLE = ("body{font-family:sans-serif;max-width:1400px;margin:2em auto;padding:0 1em;line-height:1.4}"
         "table{border-collapse:collapse;font-size:12px;margin:1em 0;display:block;overflow-x:auto}"
         "td,th{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}th{background:#f3f3f3}"
         "img{max-width:100%}code{background:#f3f3f3;padding:0 2px}a{color:#0645ad}"
         "li:target,p:target{background:#fff3b0}")


def markdown_html(text: str, images: dict[str, Path] | None = None) -> str:
    """The HTML body of ``text``; an image whose source is a key of ``images`` is embedded from that file."""
    md = MarkdownIt("commonmark").enable("table")
    tokens = md.parse(text)
    for t in tokens:
        for c in t.children or []:
            src = c.attrGet("src") if c.type == "image" else None
            if images and src in images:
                c.attrSet("src", "data:image/png;base64," + base64.b64encode(images[src].read_bytes()).decode())
    return md.renderer.render(tokens, md.options, {})


def page(text: str, title: str, images: dict[str, Path] | None = None) -> str:
    """A whole HTML page of the Markdown ``text``."""
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n{markdown_html(text, images)}</body></html>\n")
