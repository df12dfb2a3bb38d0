"""A read-only status page of a watched run (``diloco watch --serve PORT``): one HTML page and one JSON endpoint.

Both are built from the report ``diloco status -o json`` prints (a dict, handed in by the command that waits on the
run at each poll): ``/status.json`` is that report as it was last polled, ``/`` renders the same numbers for a
person, with a loss chart drawn on the server as inline SVG (no script, no CDN) and a refresh every few seconds
while the run goes on. A request never calls a backend: it is answered from the latest snapshot, built once per
poll. Every string of the report is HTML-escaped; nothing but the report is shown (no configuration, environment
or credentials), and the server answers GET and HEAD only.

The chart starts from the run's recorded history (what ``diloco plot`` draws, read once when the page starts) and
adds the losses this process sees at its polls (each replica's train and eval loss whenever its step moved).
"""

from __future__ import annotations

import html
import ipaddress
import json
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError

if TYPE_CHECKING:
    from diloco.store.objects import ObjectStore

#: The colours of the ranks' curves, in rank order (repeating).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
#: How often the page reloads itself while the run goes on, seconds.
REFRESH_S = 2
#: The most chart points kept per rank and loss (older ones are thinned), so a long run's page stays small.
MAX_POINTS = 2000

#: The columns of the replica table: (heading, report key, how the value is shown).
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("state", "state", "text"), ("step", "step", "int"), ("total steps", "total_steps", "int"),
    ("round", "round", "int"),
    ("train loss", "train_loss", "loss"), ("eval loss", "eval_loss", "loss"), ("tok/s", "tokens_per_s", "rate"),
    ("written", "bytes_written", "bytes"), ("read", "bytes_read", "bytes"), ("cost", "cost_usd", "usd"),
    ("restarts", "restarts", "int"), ("reason", "reason", "text"),
)


def is_loopback(host: str) -> bool:
    """Whether only this machine reaches ``host`` (``localhost``, ``127.0.0.0/8``, ``::1``); any other
    ``--serve-host`` is warned about."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def shown(value: Any, kind: str) -> str:
    """A report value as a person reads it (``-`` when absent)."""
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if kind == "loss":
        return f"{value:.4f}"
    if kind == "rate":
        return f"{value:,.0f}"
    if kind == "usd":
        return f"${value:,.2f}"
    if kind == "bytes":
        size, unit = float(value), "B"
        for unit in ("B", "KB", "MB", "GB", "TB"):
            if size < 1000 or unit == "TB":
                break
            size /= 1000
        return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
    return str(value)


def exact(value: Any) -> str:
    """A report value as the page carries it for programs (``data-value``): JSON, so it compares with
    ``status -o json`` exactly."""
    return json.dumps(value)


class LossHistory:
    """Each rank's ``(step, loss)`` points, train and eval: the run's recorded history when the page started
    (``seed``), then what the polls saw (a point when the step moved)."""

    def __init__(self) -> None:
        self.points: dict[str, dict[int, list[tuple[int, float]]]] = {"train_loss": {}, "eval_loss": {}}

    def seed(self, store: ObjectStore, world_size: int) -> None:
        """Start from the curves ``diloco plot`` draws (every rank's metric history in the store): read once, when
        the page starts, so a page started late still shows the run from its first step."""
        from diloco.launcher.plot import load_curves

        curves, _ = load_curves(store, world_size)
        for curve in curves:
            for key, points in (("train_loss", curve.train), ("eval_loss", curve.eval)):
                self.points[key][curve.rank] = [(step, value) for step, _, value in points][-MAX_POINTS:]

    def add(self, report: Mapping[str, Any]) -> None:
        for rep in report.get("ranks", []):
            step = rep.get("step")
            if step is None:
                continue
            for key, series in self.points.items():
                value = rep.get(key)
                if value is None:
                    continue
                points = series.setdefault(int(rep["rank"]), [])
                if points and points[-1][0] == step:
                    points[-1] = (step, float(value))
                elif not points or points[-1][0] < step:
                    points.append((step, float(value)))
                else:  # a relaunched replica starts again from its peers' round: a new stretch of the curve
                    while points and points[-1][0] >= step:
                        points.pop()
                    points.append((step, float(value)))
                if len(points) > MAX_POINTS:
                    del points[1:-1:2]


def chart_svg(history: LossHistory, width: int = 720, height: int = 260) -> str:
    """The loss chart: train loss (solid) and eval loss (dashed) per rank against the inner step, inline SVG."""
    series = [(key, rank, pts) for key, by_rank in history.points.items() for rank, pts in sorted(by_rank.items())
              if pts]
    if not series:
        return '<p class="empty">no loss reported yet</p>'
    steps = [s for _, _, pts in series for s, _ in pts]
    losses = [v for _, _, pts in series for _, v in pts]
    x0, x1 = min(steps), max(max(steps), min(steps) + 1)
    y0, y1 = min(losses), max(losses)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5
    left, right, top, bottom = 56, 12, 10, 28
    pw, ph = width - left - right, height - top - bottom

    def xy(step: int, loss: float) -> str:
        return f"{left + (step - x0) / (x1 - x0) * pw:.1f},{top + (y1 - loss) / (y1 - y0) * ph:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" id="loss-chart" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="loss per replica against the inner step">',
             f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#ccc"/>']
    for value, y in ((y1, top), (y0, top + ph)):
        parts.append(f'<text x="{left - 4}" y="{y + 4}" text-anchor="end" font-size="11">{value:.3f}</text>')
    parts.append(f'<text x="{left}" y="{height - 8}" font-size="11">step {x0}</text>')
    parts.append(f'<text x="{left + pw}" y="{height - 8}" text-anchor="end" font-size="11">step {x1}</text>')
    for key, rank, pts in series:
        colour = PALETTE[rank % len(PALETTE)]
        dash = ' stroke-dasharray="5,3"' if key == "eval_loss" else ""
        line = " ".join(xy(s, v) for s, v in pts)
        parts.append(f'<polyline class="curve" data-rank="{rank}" data-loss="{key}" data-points="{len(pts)}" '
                     f'fill="none" stroke="{colour}" stroke-width="1.5"{dash} points="{line}"/>')
    parts.append("</svg>")
    legend = " ".join(f'<span style="color:{PALETTE[rank % len(PALETTE)]}">&#9632; r{rank}</span>'
                      for rank in sorted({rank for _, rank, _ in series}))
    return "".join(parts) + f'<p class="legend">{legend} &nbsp; solid: train loss, dashed: eval loss</p>'


def _cell(rep: Mapping[str, Any], key: str, kind: str) -> str:
    value = rep.get(key)
    css = f' class="state {html.escape(str(value))}"' if key == "state" else ""
    return (f'<td data-field="{key}" data-value="{html.escape(exact(value))}"{css}>'
            f"{html.escape(shown(value, kind))}</td>")


#: The run's facts above the replica table: (heading, report key, how the value is shown).
FACTS: tuple[tuple[str, str, str], ...] = (
    ("state", "state", "text"), ("backend", "backend", "text"), ("replicas", "replicas", "int"),
    ("cost so far", "cost_usd", "usd"), ("latest eval loss", "latest_eval_loss", "loss"),
    ("final eval loss", "final_eval_loss", "loss"), ("weights identical", "weights_identical", "text"),
)


def _summary(report: Mapping[str, Any], observed_at: float) -> str:
    rows = "".join(f"<tr><th>{html.escape(name)}</th>{_cell(report, key, kind)}</tr>" for name, key, kind in FACTS)
    started, ended = report.get("created_at"), report.get("ended_at")
    if isinstance(started, (int, float)):
        rows += f"<tr><th>elapsed</th><td>{(ended or observed_at) - started:.0f} s</td></tr>"
    return f'<table class="summary">{rows}</table>'


def render_page(report: Mapping[str, Any], history: LossHistory, observed_at: float) -> str:
    """The whole HTML page of one snapshot; it reloads itself every ``REFRESH_S`` until the run has ended."""
    run_id = html.escape(str(report.get("run_id", "")))
    ended = report.get("state") in ("succeeded", "failed", "cancelled")
    refresh = "" if ended else f'<meta http-equiv="refresh" content="{REFRESH_S}">'
    head_cells = "".join(f"<th>{html.escape(name)}</th>" for name, _, _ in COLUMNS)
    rows = "".join(f'<tr data-rank="{int(rep["rank"])}"><td>r{int(rep["rank"])}</td>'
                   + "".join(_cell(rep, key, kind) for _, key, kind in COLUMNS) + "</tr>"
                   for rep in report.get("ranks", []))
    warnings = "".join(f"<li>{html.escape(str(w))}</li>" for w in report.get("warnings", []))
    failures = "".join(f"<li>r{int(rep['rank'])}: {html.escape(' | '.join(map(str, rep.get('stderr_tail') or [])))}"
                       "</li>" for rep in report.get("ranks", []) if rep.get("stderr_tail"))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(observed_at))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{refresh}
<title>diloco {run_id}: {html.escape(str(report.get("state", "")))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
th, td {{ padding: 2px 10px; text-align: right; border-bottom: 1px solid #eee; }}
table.summary th {{ text-align: left; }}
td.state {{ font-weight: 600; }} td.failed {{ color: #c00; }} td.succeeded {{ color: #080; }}
td.running {{ color: #06c; }}
.legend, .foot {{ color: #666; font-size: 90%; }}
</style></head>
<body data-run-id="{run_id}" data-ended="{str(ended).lower()}">
<h1>diloco run <code>{run_id}</code></h1>
{_summary(report, observed_at)}
<table id="replicas"><thead><tr><th>replica</th>{head_cells}</tr></thead><tbody>{rows}</tbody></table>
<h2>Loss</h2>
{chart_svg(history)}
{f'<h2>Warnings</h2><ul id="warnings">{warnings}</ul>' if warnings else ''}
{f'<h2>Failed replicas</h2><ul id="failures">{failures}</ul>' if failures else ''}
<p class="foot">as polled at {html.escape(when)}{'' if ended else f'; reloads every {REFRESH_S} s'};
the same data as <code>diloco status -o json</code>: <a href="status.json">status.json</a></p>
</body></html>
"""


class StatusPage:
    """The latest snapshot (page and JSON, built once per ``update``) and the HTTP server that hands it out."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.history = LossHistory()
        self._lock = threading.Lock()
        self._body: dict[str, tuple[bytes, str]] = {}
        page = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "diloco-status"
            sys_version = ""

            def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
                self._answer(with_body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                self._answer(with_body=False)

            def _answer(self, *, with_body: bool) -> None:
                path = self.path.split("?", 1)[0]
                found = page.body(path)
                if found is None:
                    self.send_error(404, "not found: the page is / and the report /status.json")
                    return
                body, kind = found
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'")
                self.end_headers()
                if with_body:
                    self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                """No access log on the watch's stderr."""

        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:
            raise ConfigError(f"--serve: cannot listen on {host}:{port} ({exc.strerror or exc})",
                              hint="choose another port, or 0 for any free one") from None
        self.server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        shown_host = f"[{host}]" if ":" in str(host) else host
        return f"http://{shown_host}:{port}/"

    def body(self, path: str) -> tuple[bytes, str] | None:
        with self._lock:
            if not self._body:
                placeholder = b"<!DOCTYPE html><title>diloco</title><p>waiting for the first look at the run</p>"
                return (placeholder, "text/html; charset=utf-8") if path in ("/", "/index.html") else None
            return self._body.get("/" if path == "/index.html" else path)

    def update(self, report: Mapping[str, Any], observed_at: float | None = None) -> None:
        """Show ``report`` (``status -o json``'s dict) from now on."""
        now = time.time() if observed_at is None else observed_at
        self.history.add(report)
        page = render_page(report, self.history, now).encode()
        data = (json.dumps(report, indent=2, allow_nan=False) + "\n").encode()
        with self._lock:
            self._body = {"/": (page, "text/html; charset=utf-8"), "/status.json": (data, "application/json")}

    @property
    def serving(self) -> bool:
        return self._thread is not None

    def start(self) -> StatusPage:
        """Serve from a daemon thread (it never keeps the process alive); ``close`` stops it."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self.server.serve_forever, name="diloco-status-page", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self.server.server_close()
