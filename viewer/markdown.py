"""The steps' ``report.md`` files as HTML for the viewer: the few Markdown forms the reports use — headings,
pipe tables, ``-`` lists, paragraphs, ``**bold**``, `` `code` ``, images and links to files beside the
report — and nothing else. Every piece of text is HTML-escaped first, so a report (whose cells hold captions
and error messages from the data) cannot inject markup; a link or image may only name a file of the run
(no scheme, no absolute path: ``viewer.files.run_file`` serves it, or refuses)."""
from __future__ import annotations

import html
import re

_INLINE = [
    (re.compile(r"!\[([^\]]*)\]\(([^)\s]+)\)"), lambda m, base: (
        f'<img src="{_href(m[2], base)}" alt="{m[1]}">' if _local(m[2]) else m[0])),
    (re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)"), lambda m, base: (
        f'<a href="{_href(m[2], base)}">{m[1]}</a>' if _local(m[2]) else m[0])),
    (re.compile(r"\*\*([^*]+)\*\*"), lambda m, base: f"<strong>{m[1]}</strong>"),
    (re.compile(r"`([^`]+)`"), lambda m, base: f"<code>{m[1]}</code>"),
]


def _local(url: str) -> bool:
    return not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url) and not url.startswith(("/", "\\")) and ".." not in url


def _href(url: str, base: str) -> str:
    return f"/files/{base}/{url}" if base else f"/files/{url}"


def _inline(text: str, base: str) -> str:
    out = html.escape(text, quote=True)
    for rx, fn in _INLINE:
        out = rx.sub(lambda m: fn(m, base), out)
    return out


def _cells(line: str) -> list[str]:
    line = line.strip().strip("|")
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)]


def render(text: str, base: str = "") -> str:
    """``text`` (a report's Markdown) as HTML; ``base``: the report's folder, relative to the run (its links)."""
    out: list[str] = []
    para: list[str] = []
    lines = text.splitlines()

    def flush():
        if para:
            out.append(f"<p>{_inline(' '.join(para), base)}</p>")
            para.clear()

    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(#{1,4})\s+(.*)$", line)
        if m:
            flush()
            n = len(m[1]) + 1            # the page's own title is the h1
            out.append(f"<h{n}>{_inline(m[2], base)}</h{n}>")
        elif line.lstrip().startswith("|"):
            flush()
            rows = []
            while i < len(lines) and lines[i].lstrip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            sep = len(rows) > 1 and all(re.fullmatch(r":?-{3,}:?", c) for c in rows[1])
            head, body = (rows[0], rows[2:]) if sep else (None, rows)
            t = ["<table>"]
            if head:
                t.append("<tr>" + "".join(f"<th>{_inline(c, base)}</th>" for c in head) + "</tr>")
            t += ["<tr>" + "".join(f"<td>{_inline(c, base)}</td>" for c in r) + "</tr>" for r in body]
            out.append("".join(t) + "</table>")
            continue
        elif re.match(r"^\s*[-*]\s+", line):
            flush()
            items = []
            while i < len(lines) and re.match(r"^\s*[-*]\s+", lines[i]):
                items.append(f"<li>{_inline(re.sub(r'^\s*[-*]\s+', '', lines[i]), base)}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif not line.strip():
            flush()
        else:
            para.append(line.strip())
        i += 1
    flush()
    return "\n".join(out)
