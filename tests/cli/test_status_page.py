"""``diloco watch --serve PORT --notify URL`` through the real CLI on the local backend, read by a real headless
Chromium: the page shows what ``diloco status -o json`` says while the run is held still mid-way and after it ended,
its screenshot is taken, and a loopback webhook receives each event once (the relaunch of a replica that SIGKILLed
itself, and the run's end with its verdict). Then the page's own rules: every string escaped, only the report shown,
loopback by default, read-only, and launch's refusals before anything is launched.

Chromium is Debian's package, which ``make setup`` installs (``make browser``); without it the browser test fails
saying so, it is never skipped.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from functools import partial
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from support.commands import run_cli, start_cli
from support.polling import wait_for_file
from support.webhook import WebhookReceiver

from diloco.errors import ConfigError
from diloco.launcher.status_page import StatusPage

cli = partial(run_cli, restart_backoff_s=0, timeout=180)
#: The fields of each replica the page must show exactly as ``status -o json`` says them.
RANK_FIELDS = ("state", "step", "total_steps", "round", "train_loss", "eval_loss", "bytes_written", "bytes_read",
               "cost_usd", "restarts")
RUN_FIELDS = ("state", "backend", "replicas", "cost_usd", "latest_eval_loss", "final_eval_loss")


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: run `make setup` (its `browser` step installs Debian's chromium)")
    return found


def browse(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           f"--user-data-dir={profile}", *extra, url], capture_output=True, text=True, timeout=120)


class PageValues(HTMLParser):
    """The ``data-value`` of every cell the page marks with ``data-field``: per replica (``data-rank`` rows) and for
    the run (the summary table)."""

    def __init__(self) -> None:
        super().__init__()
        self.rank: int | None = None
        self.ranks: dict[int, dict[str, Any]] = {}
        self.run: dict[str, Any] = {}
        self.body: dict[str, str | None] = {}
        self.curves: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "body":
            self.body = found
        if tag == "tr":
            self.rank = int(found["data-rank"] or 0) if "data-rank" in found else None
        if tag == "polyline":
            self.curves.append(found)
        if tag == "td" and "data-field" in found:
            value = json.loads(found["data-value"] or "null")
            target = self.ranks.setdefault(self.rank, {}) if self.rank is not None else self.run
            target[str(found["data-field"])] = value


def page_in_chromium(url: str, profile: Path) -> PageValues:
    out = browse(url, profile, "--dump-dom")
    assert out.returncode == 0 and "<body" in out.stdout, out.stderr[-2000:]
    values = PageValues()
    values.feed(out.stdout)
    return values


def assert_page_says(page: PageValues, status: dict[str, Any]) -> None:
    assert page.body["data-run-id"] == status["run_id"]
    assert {k: page.run[k] for k in RUN_FIELDS} == {k: status[k] for k in RUN_FIELDS}
    for rep in status["ranks"]:
        assert {k: page.ranks[rep["rank"]][k] for k in RANK_FIELDS} == {k: rep[k] for k in RANK_FIELDS}, rep["rank"]


def read_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - loopback
        return json.loads(response.read())


def compared(report: dict[str, Any]) -> Any:
    return ({k: report[k] for k in RUN_FIELDS}, [{k: r[k] for k in RANK_FIELDS} for r in report["ranks"]])


def without_weights(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in ("weights_identical", "weights_detail")}


def settled(url: str, status: dict[str, Any], patience_s: float = 60) -> dict[str, Any]:
    """The page's JSON once its poll has caught up with ``status`` (read after the run was held still)."""
    give_up = time.monotonic() + patience_s
    while True:
        page = read_json(url)
        if compared(page) == compared(status) or time.monotonic() > give_up:
            return page
        time.sleep(0.05)


def test_the_page_in_chromium_shows_what_status_json_says_and_the_webhook_hears_each_event_once(
        tmp_path: Path) -> None:
    home, gate = tmp_path / "home", tmp_path / "gate"
    gate.mkdir()
    kill = [{"trial": 0, "rank": 1, "moment": "mid_round", "round": 1, "step": 1}]
    launch = cli("launch", "--replicas", "2", "--backend", "local", "--trainer", "support.gated_trainer:train",
                 "--steps", "6", "--sync-every", "3", "-k", "gate_step=3", "-k", f"gate_dir={gate}", "-k", f"done_dir={tmp_path}",
                 "-k", f"kills={json.dumps(kill)}", "--set", "store.poll_interval_s=0.05", "--detach", "-o", "json",
                 home=home)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    with WebhookReceiver() as hook:
        watch = start_cli("watch", run_id, "--serve", "0", "--serve-linger", "120", "--notify", hook.url,
                          "--notify-cost", "1000", "-o", "json", home=home, restart_backoff_s=0)
        try:
            assert watch.stderr is not None
            narration = [watch.stderr.readline() for _ in range(2)]
            url = next(line.split()[2] for line in narration if line.startswith("status page: "))
            assert url.startswith("http://127.0.0.1:"), narration

            def status() -> dict[str, Any]:
                out = cli("status", run_id, "-o", "json", home=home)
                assert out.returncode == 0, out.stderr
                return json.loads(out.stdout)

            # during: both replicas held at the gate, rank 1 relaunched once
            for rank in (0, 1):
                wait_for_file(f"rank_{rank}.waiting", gate)
            now = status()
            assert compared(settled(url + "status.json", now)) == compared(now)
            assert now["state"] == "running" and [r["restarts"] for r in now["ranks"]] == [0, 1], now
            assert all(r["train_loss"] is not None for r in now["ranks"])
            during = page_in_chromium(url, tmp_path / "profile")
            assert_page_says(during, now)
            assert during.body["data-ended"] == "false"
            assert {c["data-rank"] for c in during.curves if c["data-loss"] == "train_loss"} == {"0", "1"}
            shot = tmp_path / "during.png"
            browse(url, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1100,900")
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000

            # after: the run ends; watch serves the final page until interrupted
            (gate / "open").write_text("open\n")
            line = ""
            while "serving its final page" not in line:
                line = watch.stderr.readline()
                assert line, "watch ended without serving its final page"
            final = status()
            assert final["state"] == "succeeded", final
            after = page_in_chromium(url, tmp_path / "profile")
            assert_page_says(after, final)
            assert after.body["data-ended"] == "true" and after.run["weights_identical"] is True
            served = read_json(url + "status.json")  # the whole report, plus the weights check watch made
            assert served["weights_identical"] is True and final["weights_identical"] is None
            assert without_weights(served) == without_weights(final)
            watch.send_signal(signal.SIGINT)  # ends the linger; the exit code stays the run's
            out, _ = watch.communicate(timeout=60)
            assert watch.returncode == 0, out[-2000:]
            assert json.loads(out)["state"] == "succeeded"
        finally:
            watch.kill()
    events = [b["diloco"]["event"] for b in hook.bodies]
    assert events == ["replica_failed", "replica_relaunched", "run_ended"], hook.bodies
    assert hook.events("replica_relaunched")[0]["rank"] == 1
    assert hook.events("run_ended")[0]["verdict"].startswith("succeeded (exit 0)")


def report(**fields: Any) -> dict[str, Any]:
    rank = {"rank": 0, "state": "failed", "step": 3, "total_steps": 10, "round": 1, "train_loss": 2.0,
            "eval_loss": None, "reason": "<script>alert(1)</script>", "stderr_tail": ["<b>boom</b> & more"],
            "restarts": 0}
    return {"schema_version": 1, "run_id": "run-<i>x</i>", "backend": "local", "state": "running",
            "created_at": 1.0, "replicas": 1, "ranks": [rank], "warnings": ["a <warning>"], **fields}


def fetch(url: str, method: str = "GET") -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def test_the_page_escapes_every_string_serves_only_the_report_and_is_read_only() -> None:
    page = StatusPage().start()
    try:
        assert page.url.startswith("http://127.0.0.1:")
        code, text, _ = fetch(page.url)
        assert code == 200 and "waiting for the first look" in text
        page.update(report(), 10.0)
        code, text, headers = fetch(page.url)
        assert code == 200 and headers["Content-Security-Policy"].startswith("default-src 'none'")
        assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
        assert "<i>x</i>" not in text and "run-&lt;i&gt;x&lt;/i&gt;" in text
        assert "&lt;b&gt;boom&lt;/b&gt; &amp; more" in text and "a &lt;warning&gt;" in text
        code, data, headers = fetch(page.url + "status.json")
        assert code == 200 and headers["Content-Type"] == "application/json" and json.loads(data) == report()
        assert fetch(page.url + "etc/passwd")[0] == 404
        assert fetch(page.url, method="POST")[0] == 501
        page.update(report(state="failed"), 11.0)
        assert 'http-equiv="refresh"' not in fetch(page.url)[1]  # an ended run's page is final
    finally:
        page.close()


def test_the_chart_starts_from_the_runs_recorded_history_and_goes_on_with_the_polls(tmp_path: Path) -> None:
    from diloco.store.layout import METRICS_KEY
    from diloco.store.objects import ObjectStore

    store = ObjectStore(f"file://{tmp_path}/store")
    for rank in (0, 1):
        rows = [{"kind": "init", "step": 0, "round": 0, "eval_loss": 5.0},
                {"kind": "round", "step": 5, "round": 1, "train_loss": 4.0 + rank, "eval_loss": 4.5},
                {"kind": "round", "step": 10, "round": 2, "train_loss": 3.0 + rank, "eval_loss": 3.5}]
        text = "".join(json.dumps({"time": 100.0 + row["step"], "total_steps": 20, **row}) + "\n" for row in rows)
        store.put(METRICS_KEY.format(rank=rank), text.encode())
    page = StatusPage()
    try:
        page.history.seed(store, 2)
        assert page.history.points["train_loss"] == {0: [(5, 4.0), (10, 3.0)], 1: [(5, 5.0), (10, 4.0)]}
        assert page.history.points["eval_loss"][0] == [(0, 5.0), (5, 4.5), (10, 3.5)]
        page.update(report(ranks=[{"rank": 0, "state": "running", "step": 12, "train_loss": 2.5}]), 10.0)
        assert page.history.points["train_loss"][0] == [(5, 4.0), (10, 3.0), (12, 2.5)]
        svg = page.body("/")[0].decode()  # type: ignore[index]
        assert 'data-rank="0" data-loss="train_loss" data-points="3"' in svg
        assert 'data-rank="1" data-loss="eval_loss" data-points="3"' in svg
    finally:
        page.close()


def test_any_host_but_loopback_is_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    from diloco.cli.watch import Observers
    from diloco.launcher.status_page import is_loopback

    assert all(map(is_loopback, ("127.0.0.1", "127.0.0.2", "localhost", "::1")))
    assert not any(map(is_loopback, ("0.0.0.0", "10.1.2.3", "example.invalid")))
    Observers(serve=0).close()
    assert capsys.readouterr().err == ""
    Observers(serve=0, serve_host="0.0.0.0").close()
    assert "warning: --serve-host 0.0.0.0: the status page is reachable from the network" in capsys.readouterr().err


def test_a_busy_port_is_a_usage_error_naming_serve() -> None:
    page = StatusPage()
    try:
        with pytest.raises(ConfigError, match="--serve: cannot listen on 127.0.0.1:"):
            StatusPage(port=page.server.server_address[1])
    finally:
        page.close()


def test_serve_and_notify_need_a_launch_that_waits_and_nothing_is_launched(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from diloco.cli.main import app

    home = tmp_path / "home"

    def diloco(*args: str) -> Any:
        return CliRunner().invoke(app, list(args), env={"DILOCO_HOME": str(home), "NO_COLOR": "1"})

    launch = ("launch", "--replicas", "1", "--backend", "local", "--trainer", "support.cli_trainers:slow",
              "--steps", "4", "--sync-every", "2")
    for extra in (["--detach", "--serve", "0"], ["--dry-run", "--notify", "http://127.0.0.1:9/hook"]):
        out = diloco(*launch, *extra)
        assert out.exit_code == 2 and "--serve/--notify: need a launch that waits" in out.stderr, out.stderr
    out = diloco(*launch, "--notify", "hooks.example/x")
    assert out.exit_code == 2 and "--notify: expected an http(s) URL" in out.stderr, out.stderr
    out = diloco("watch", "--notify-cost", "5")
    assert out.exit_code == 2 and "--notify-cost: needs --notify" in out.stderr, out.stderr
    assert not list(home.glob("runs/*")), "nothing launched or recorded"
