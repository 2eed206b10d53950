"""The words of a live look at a job: a header and a table, a row a rank (``mpddp top``, a notebook cell).

Owns: :func:`table`, which only renders a :class:`~mpddp.core.launcher.live_snapshot.Snapshot`
(deciding what a row says is live.py's), fitted to a width, and :func:`html`, the same look for a notebook cell.
Plain text: a terminal redraws it whole; a cell shows the HTML, with the text beside it for front ends without.
"""

from __future__ import annotations

from html import escape

from .live_snapshot import RankRow, Snapshot

_COLUMNS = ("RANK", "NODE", "LOCAL", "STATE", "COLL/S", "LAST COLLECTIVE", "LAG", "CPU", "RSS", "GPU", "LAST LINE")


def table(snapshot: Snapshot, width: int = 120) -> str:
    """The header, the first failure once there is one, a row a rank, and the nodes not heard from yet."""
    h = snapshot.header
    nodes = (f"{h.nnodes} node(s)" + (f" of {h.max_nnodes}" if h.max_nnodes != h.nnodes else "")
             + (f" + {h.spares} waiting" if h.spares else ""))
    where = f"node {h.node} ({h.host})" if h.node is not None else h.host
    lines = _fitted([f"mpddp top  job {h.job}", f"round {h.round}", f"{h.world_size} rank(s) on {nodes}",
                     f"restarts {h.restarts}", f"up {_clock(h.elapsed)}", f"seen from {where}"], width)
    if h.failure:
        lines.append(f"first failure: {h.failure}")
    rows = [_COLUMNS] + [_cells(r) for r in snapshot.ranks]
    gpu = any(r.gpu is not None for r in snapshot.ranks)
    keep = [i for i, name in enumerate(_COLUMNS) if gpu or name != "GPU"]
    widths = {i: max(len(row[i]) for row in rows) for i in keep[:-1]}
    for row in rows:
        text = "  ".join(row[i].rjust(widths[i]) if i in _RIGHT else row[i].ljust(widths[i]) for i in keep[:-1])
        lines.append(f"{text}  {row[keep[-1]]}"[:width].rstrip())
    if not snapshot.ranks:
        lines.append("(no rank running: the launcher waits for its round, or its ranks have not started)")
    if len({r.node for r in snapshot.ranks}) > 1:  # each node's rows are of their own moment: how old they are
        ages = {r.node: r.age for r in snapshot.ranks}
        lines.append("rows' age: " + ", ".join(f"node {n} {a:.1f} s" for n, a in sorted(ages.items())))
    if snapshot.missing:
        lines.append(f"not heard from yet: node(s) {', '.join(map(str, snapshot.missing))} (their rows come with "
                     "their next beat)")
    if any(r.straggler for r in snapshot.ranks):
        lines.append("* the straggler: the rank the others wait for at collectives")
    return "\n".join(map(_printable, lines))


def _printable(line: str) -> str:
    """A line as text only: a rank's own escape sequences (colours, ``\r`` of a progress bar), or a launcher's that
    answers what it should not, never move the terminal's cursor nor change its title; each becomes ``?``."""
    return line if line.isprintable() else "".join(c if c.isprintable() else "?" for c in line)


_RIGHT = {0, 1, 2, 4, 6, 7, 8}


def _fitted(parts: list[str], width: int) -> list[str]:
    """The header's parts on as few lines as ``width`` allows (an 80-column terminal: two), two spaces apart."""
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += "  " + part
        else:
            lines.append(part)
    return lines


def _cells(r: RankRow) -> tuple[str, ...]:
    lag = "" if r.lag_ms is None else f"{r.lag_ms:+.1f} ms" + (" *" if r.straggler else "")
    gpu = "" if r.gpu is None else f"{r.gpu}: " + " ".join(
        x for x in ("" if r.gpu_util is None else f"{r.gpu_util}%",
                    "" if r.gpu_mib is None else f"{r.gpu_mib} MiB") if x)
    return (str(r.rank), str(r.node), str(r.local_rank), r.state,
            "" if r.per_second is None else f"{r.per_second:.1f}", r.last or "", lag,
            "" if r.cpu is None else f"{r.cpu:.0f}%", "" if r.rss is None else _size(r.rss), gpu, r.line.strip())


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def html(snapshot: Snapshot) -> str:
    """The same look as :func:`table`, as an HTML table for a notebook cell (a straggler's row in bold)."""
    lines = [escape(line) for line in table(snapshot, width=1 << 16).splitlines()]
    above = 2 if snapshot.header.failure else 1  # the header (one line at this width), and the first failure
    gpu = any(r.gpu is not None for r in snapshot.ranks)
    keep = [i for i, name in enumerate(_COLUMNS) if gpu or name != "GPU"]
    rows = [_html_row("th", _COLUMNS, keep, False)] + [_html_row("td", _cells(r), keep, r.straggler)
                                                       for r in snapshot.ranks]
    return (f'<div style="font-family:monospace">{"<br>".join(lines[:above])}'
            f'<table style="border-collapse:collapse">{"".join(rows)}</table>'
            f'{"<br>".join(lines[above + 1 + len(snapshot.ranks):])}</div>')


def _html_row(tag: str, cells: tuple[str, ...], keep: list[int], bold: bool) -> str:
    tds = "".join(f'<{tag} style="padding:0 .6em;text-align:{"right" if i in _RIGHT else "left"}">{escape(cells[i])}'
                  f"</{tag}>" for i in keep)
    return f'<tr style="font-weight:bold">{tds}</tr>' if bold else f"<tr>{tds}</tr>"
