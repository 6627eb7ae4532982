"""The dashboard (lsgd/status/dashboard.html) in a real headless browser (issue 10).

Most tests load it from a stub server that simulates a job in the documented schema
(tests/status_stub.py); one loads it from the global server of a real 2-node job. Browser tests
skip where no Chromium or Chrome is installed (CI installs Debian's chromium). With
LSGD_DOCS_SCREENSHOT=<png> the real job's screenshot is also copied there (the docs' picture).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

import headless
from status_stub import DASHBOARD, StubJob, StubServer

BROWSER = headless.find_browser()
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no chromium, chromium-browser or google-chrome "
                                                           "on PATH (apt-get install chromium)")


@pytest.fixture
def stub(request):
    servers: list[StubServer] = []

    def start(**kwargs) -> StubServer:
        job = kwargs.pop("job", None) or StubJob()
        servers.append(StubServer(job, **kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_the_page_is_one_self_contained_file():
    html = DASHBOARD.read_text()
    assert "<canvas" in html and "<script>" in html
    # nothing to fetch from elsewhere: no script, style sheet, font or image by address
    assert not re.search(r"<(script|link|img|iframe)[^>]*\s(src|href)=\"(?!data:)", html, re.I)
    assert not re.search(r"https?://|@import|url\(", html, re.I)
    # the only requests: the two status endpoints, relative to the page
    assert sorted(set(re.findall(r"getJSON\(\"([^\"?]+)", html))) == ["./history.json", "./status.json"]
    assert html.count("fetch(") == 1


@needs_browser
@pytest.mark.timeout(90)
def test_the_page_shows_the_job_and_polls_once_a_second(stub):
    server = stub()
    dom = headless.dump_dom(BROWSER, server.url, budget_ms=5000)
    assert dom.find(tag="body")[0]["data-status"] == "ok", dom.text.get("message")
    nodes = [e["data-node"] for e in dom.elements if e["tag"] == "tr" and "data-alive" in e]
    assert nodes == ["0", "1"]
    workers = [(e["data-worker"], e["data-node"]) for e in dom.elements if e["tag"] == "tr" and "data-worker" in e]
    assert workers == [("0", "0"), ("1", "0"), ("2", "1"), ("3", "1")]
    # the leader shown is the one of the round it names (the job may have moved on since)
    leader = dom.by_id("leader")
    shown = int(re.search(r"round\s*([\d,]+)", dom.text["leader"]).group(1).replace(",", ""))
    rounds = {e["id"]: e for kind, e in server.job.entries if kind == "rounds"}
    assert leader["data-worker"] == str(rounds[shown]["leader"]), (dom.text["leader"], rounds[shown])
    assert leader["data-node"] == str(rounds[shown]["leader_node"])
    assert f"worker {leader['data-worker']}" in dom.text["leader"]
    assert "demo" in dom.text["job-id"] and dom.text["state"] == "running"
    assert re.search(r"[\d,]+ / 60,000 iterations \(\d+%\)", dom.text["counter"]), dom.text["counter"]
    for chart in ("chart-loss", "chart-distance", "chart-timeline"):
        canvas = dom.by_id(chart)
        assert int(canvas["data-drawn"]) >= 1 and int(canvas["data-points"]) > 0, (chart, canvas)
    metrics = sorted(e["data-metric"] for e in dom.elements if e["tag"] == "canvas" and "data-metric" in e)
    assert metrics == ["accuracy", "loss"]
    assert all(int(e["data-points"]) > 0 for e in dom.elements if "data-metric" in e)
    # cheap for the server: one status and one history request a (virtual) second, no more
    statuses, histories = server.paths("/status.json"), server.paths("/history.json")
    assert 3 <= len(statuses) <= 7, statuses
    assert len(histories) == len(statuses), (statuses, histories)
    # incremental: each history request starts where the previous answer ended
    since = [int(parse_qs(urlsplit(p).query)["since"][0]) for p in histories]
    assert since[0] == 0 and since == sorted(since) and since[-1] > 1, since
    assert all(auth is None for _, auth in server.requests)  # no token in the address: none sent
    assert {urlsplit(p).path for p, _ in server.requests} == {"/", "/status.json", "/history.json"}


@needs_browser
@pytest.mark.timeout(90)
def test_a_token_in_the_address_goes_in_a_header_and_nowhere_else(stub):
    server = stub(token="s3cret-token")
    dom = headless.dump_dom(BROWSER, server.url + "?token=s3cret-token", budget_ms=3000)
    assert dom.find(tag="body")[0]["data-status"] == "ok", dom.text.get("message")
    assert len([e for e in dom.elements if e["tag"] == "tr" and "data-alive" in e]) == 2
    json_requests = [(p, a) for p, a in server.requests if urlsplit(p).path != "/"]
    assert {urlsplit(p).path for p, _ in json_requests} == {"/status.json", "/history.json"}, json_requests
    assert all(a == "Bearer s3cret-token" for _, a in json_requests), json_requests
    assert not any("s3cret" in p for p, _ in json_requests)


@needs_browser
@pytest.mark.timeout(90)
def test_a_wrong_token_says_how_to_get_the_right_one(stub):
    server = stub(token="s3cret-token")
    dom = headless.dump_dom(BROWSER, server.url + "?token=wrong", budget_ms=5000)
    assert dom.find(tag="body")[0]["data-status"] == "unauthorized"
    assert "Not authorized" in dom.text["message"] and "python -m lsgd status --url" in dom.text["message"]
    assert not dom.find(tag="tr", data_alive="true")
    assert 1 <= len(server.paths("/status.json")) <= 3  # backs off instead of hammering the server


@needs_browser
@pytest.mark.timeout(90)
def test_a_server_that_goes_away_leaves_the_last_data_on_the_page(stub):
    server = stub(fail_after=2)
    dom = headless.dump_dom(BROWSER, server.url, budget_ms=8000)
    assert dom.find(tag="body")[0]["data-status"] == "unreachable"
    assert "does not answer" in dom.text["message"] and "STATUS_PORT=0" in dom.text["message"]
    assert len(dom.find(tag="tr", data_alive="true")) == 2  # the last data is still shown
    assert dom.by_id("leader")["data-worker"] != ""
    # failures back off (2, 4, 8 s): no spinning on a dead server, even with timers run ahead
    assert len(server.paths("/status.json")) <= 2 + 3, server.requests


@needs_browser
@pytest.mark.timeout(90)
def test_a_restarted_global_server_has_its_history_read_anew(stub):
    old, new = StubJob(started_s=60.0), StubJob(started_s=5.0, seed=2, restarts=1)
    server = stub(job=old, restart=(3, new))
    dom = headless.dump_dom(BROWSER, server.url, budget_ms=6000)
    since = [int(parse_qs(urlsplit(p).query)["since"][0]) for p in server.paths("/history.json")]
    assert since[0] == 0 and since[1] > 0 and since.count(0) == 2, since  # read again from 0
    rounds = sum(kind == "rounds" for kind, _ in new.entries)
    assert 0 < int(dom.by_id("chart-timeline")["data-points"]) <= rounds < 100  # the new history only


@needs_browser
@pytest.mark.timeout(120)
def test_a_long_history_stays_bounded_in_the_page(stub):
    # ~23,400 global rounds and points per worker: more than the page keeps (20,000 a series)
    job = StubJob(budget=10**8, rate=800.0, started_s=7500.0)
    server = stub(job=job)
    dom = headless.dump_dom(BROWSER, server.url, budget_ms=30000, timeout=100)
    assert dom.find(tag="body")[0]["data-status"] == "ok"
    since = [int(parse_qs(urlsplit(p).query)["since"][0]) for p in server.paths("/history.json")]
    assert since[-1] >= 4 * 23000, since  # it read the whole history, 5,000 entries a call
    loss = int(dom.by_id("chart-loss")["data-points"])
    assert 4 * 20000 <= loss <= 4 * 22000, loss
    assert 20000 <= int(dom.by_id("chart-timeline")["data-points"]) <= 22000


@needs_browser
@pytest.mark.timeout(90)
def test_a_screenshot_of_the_stub_job(stub, tmp_path):
    server = stub()
    png = headless.screenshot(BROWSER, server.url, tmp_path / "dashboard.png", budget_ms=4000)
    assert png.stat().st_size > 20_000  # tables and charts, not a blank page


# ---- the dashboard of a real job -------------------------------------------------------------

TOY = dict(ENTRY="toyjob:main", LOG_LEVEL="INFO")


def wait_for_file(path: Path, nodes, timeout: float) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        for node in nodes:
            assert node.proc.poll() is None, f"node {node.index} exited early:\n{node.output}"
        time.sleep(0.1)
    raise AssertionError(f"{path} was not written in {timeout} s")


def exit_code(node, timeout: float) -> int | None:
    try:
        return node.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


@needs_browser
@pytest.mark.timeout(240)
def test_the_dashboard_of_a_running_two_node_job(cluster, tmp_path):
    # 2 nodes x 2 workers that train far longer than the test: it stops the job itself
    knobs = dict(NUM_GROUPS=2, ITERATIONS=10**6, TOYJOB_STEP_SECONDS="0.002", EVAL_EVERY=4000,
                 NODE_TIMEOUT=5, **TOY)
    n0 = cluster(0, PORT=0, **knobs)
    n1 = cluster(1, PORT=cluster.port_of_node0(), **knobs)
    try:
        port = int(wait_for_file(cluster.run_dir / "global" / "status.port", [n0, n1], 60))
        url = f"http://127.0.0.1:{port}/"
        docs_png = os.environ.get("LSGD_DOCS_SCREENSHOT")
        end = time.monotonic() + (90 if docs_png else 60)
        settle = time.monotonic() + (40 if docs_png else 0)  # a longer history for the docs' picture
        dom = None
        while time.monotonic() < end:  # until both nodes have reported and a global round closed
            dom = headless.dump_dom(BROWSER, url, budget_ms=3000)
            nodes = {e["data-node"] for e in dom.elements if e["tag"] == "tr" and e.get("data-alive") == "true"}
            if nodes == {"0", "1"} and dom.by_id("leader")["data-worker"] and time.monotonic() > settle:
                break
            time.sleep(1)
        assert dom is not None and dom.find(tag="body")[0]["data-status"] == "ok", dom and dom.text.get("message")
        nodes = {e["data-node"] for e in dom.elements if e["tag"] == "tr" and e.get("data-alive") == "true"}
        assert nodes == {"0", "1"}, dom.text.get("nodes")
        leader = dom.by_id("leader")
        assert leader["data-worker"] and leader["data-node"] in ("0", "1"), dom.text.get("leader")
        assert f"worker {leader['data-worker']}" in dom.text["leader"]
        workers = {e["data-worker"] for e in dom.elements if e["tag"] == "tr" and "data-worker" in e}
        assert workers == {"0", "1", "2", "3"} and leader["data-worker"] in workers
        assert dom.text["state"] == "running"
        assert int(dom.by_id("chart-timeline")["data-points"]) > 0
        assert int(dom.by_id("chart-loss")["data-points"]) > 0
        png = headless.screenshot(BROWSER, url, tmp_path / "dashboard.png", budget_ms=3000,
                                  window=(1280, 1000))
        assert png.stat().st_size > 20_000
        if docs_png:
            shutil.copyfile(png, docs_png)
    finally:  # stop the job: node 0 ends it everywhere (also when the test failed)
        if n0.proc.poll() is None:
            n0.proc.send_signal(signal.SIGTERM)
        codes = [exit_code(n0, 30), exit_code(n1, 30)]
    assert codes == [143, 4], n0.output + n1.output  # SIGTERM; exitcodes.STOPPED
