"""The demo's report in a real browser: headless Chromium, driven over the DevTools protocol.

Chromium is started with `--remote-debugging-pipe`: the DevTools protocol as JSON messages,
each ended by a NUL byte, on the child's fd 3 (commands in) and fd 4 (replies and events
out), so no websocket client is needed (`Pipe`, ~60 lines). The page is loaded at a
1280x800 viewport (Emulation.setDeviceMetricsOverride) and checked as a user sees it:

* every <img> has loaded (complete, naturalWidth > 0): the figures are data URIs, a broken
  one shows as a zero-width image;
* nothing reached the console at level error (Runtime.consoleAPICalled, Log.entryAdded) and
  no script threw (Runtime.exceptionThrown);
* "What this log says" is above the fold: its bounding box ends above 800 px.

A screenshot of the top (1280x800) is written next to the report (and to $MR_SCREENSHOT
when set). The test skips, saying why, only where no Chromium can be started (none on PATH,
or it exits or never answers); .ci/run installs Debian's `chromium` package. Slow: Chromium
starts in 1-3 s, the demo takes ~10 s.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from mismatch_replay.viz.jobs import demo

pytestmark = pytest.mark.slow

WIDTH, HEIGHT = 1280, 800
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


class Pipe:
    """A DevTools client over --remote-debugging-pipe: `call` sends a command and returns its
    result; every event read meanwhile is kept in `events`."""

    def __init__(self, exe: str, profile: str, log):
        to_child, self._w = os.pipe()  # we write commands: the child's fd 3
        self._r, from_child = os.pipe()  # we read replies: the child's fd 4
        actions = [
            (os.POSIX_SPAWN_DUP2, to_child, 3),
            (os.POSIX_SPAWN_DUP2, from_child, 4),
            (os.POSIX_SPAWN_DUP2, log.fileno(), 1),
            (os.POSIX_SPAWN_DUP2, log.fileno(), 2),
        ]
        args = [exe, *FLAGS, f"--user-data-dir={profile}", "about:blank"]
        self.pid = os.posix_spawn(exe, args, os.environ, file_actions=actions)
        os.close(to_child)
        os.close(from_child)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the browser")
            ready, _, _ = select.select([self._r], [], [], left)
            if ready:
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise EOFError("the browser closed its pipe")
                self._buf += chunk
        msg, _, self._buf = self._buf.partition(b"\0")
        return json.loads(msg)

    def call(self, method: str, session: str | None = None, timeout: float = 60, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            got = self._read(deadline)
            if got.get("id") == self._id:
                if "error" in got:
                    raise RuntimeError(f"{method}: {got['error']}")
                return got.get("result", {})
            self.events.append(got)

    def wait_event(self, method: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        while True:
            got = self._read(deadline)
            if got.get("method") == method:
                return got
            self.events.append(got)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("Browser.close", timeout=10)
        for fd in (self._r, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)
        for _ in range(50):
            done, _ = os.waitpid(self.pid, os.WNOHANG)
            if done:
                return
            time.sleep(0.1)
        os.kill(self.pid, 9)
        os.waitpid(self.pid, 0)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    exe = next((p for p in map(shutil.which, BROWSERS) if p), None)
    if exe is None:
        pytest.skip(
            f"no Chromium on PATH (looked for {', '.join(BROWSERS)}); apt-get install chromium"
        )
    log_path = tmp_path_factory.mktemp("chromium") / "chromium.log"
    profile = tempfile.mkdtemp(prefix="mr-chromium-")  # a new profile: no state, no prompts
    with open(log_path, "wb") as log:
        try:
            pipe = Pipe(exe, profile, log)
        except OSError as exc:
            pytest.skip(f"{exe} cannot be started: {exc}")
        try:
            version = pipe.call("Browser.getVersion", timeout=60)
        except (TimeoutError, EOFError) as exc:
            pipe.close()
            tail = log_path.read_text(errors="replace")[-800:]
            pytest.skip(f"{exe} did not start ({exc}): {tail}")
        yield pipe, version
        pipe.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def demo_report(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    return demo(out, force=True)["report"]


CHECKS = """(() => {
  const imgs = [...document.images].map(i => ({alt: i.alt, complete: i.complete,
                                               w: i.naturalWidth, h: i.naturalHeight}));
  const f = document.querySelector("section.findings");
  const r = f ? f.getBoundingClientRect() : null;
  return {imgs, findings: r && {top: r.top, bottom: r.bottom},
          items: f ? [...f.querySelectorAll("li")].map(li => li.textContent) : [],
          viewport: [window.innerWidth, window.innerHeight], scroll: window.scrollY};
})()"""


def _errors(events: list[dict]) -> list[str]:
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append(f"console.{p['type']}: {[a.get('value') for a in p.get('args', [])]}")
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append(f"{d.get('text')}: {d.get('exception', {}).get('description')}")
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append(f"log: {p['entry'].get('text')} ({p['entry'].get('url', '')})")
    return out


def load(pipe: Pipe, page: Path) -> tuple[dict, list[str], bytes]:
    """Open `page` in a new tab at 1280x800: (the CHECKS' values, the console's errors, a
    screenshot of the top as PNG bytes)."""
    target = pipe.call("Target.createTarget", url="about:blank")["targetId"]
    session = pipe.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
    for domain in ("Page", "Runtime", "Log"):
        pipe.call(f"{domain}.enable", session)
    pipe.call(
        "Emulation.setDeviceMetricsOverride",
        session,
        width=WIDTH,
        height=HEIGHT,
        deviceScaleFactor=1,
        mobile=False,
    )
    pipe.events.clear()
    pipe.call("Page.navigate", session, url=page.resolve().as_uri())
    pipe.wait_event("Page.loadEventFired", timeout=60)
    got = pipe.call("Runtime.evaluate", session, expression=CHECKS, returnByValue=True)
    shot = pipe.call("Page.captureScreenshot", session, format="png")["data"]
    errors = _errors([e for e in pipe.events if e.get("sessionId") == session])
    pipe.call("Target.closeTarget", targetId=target)
    return got["result"]["value"], errors, base64.b64decode(shot)


def test_report_in_headless_chromium(browser, demo_report):
    pipe, version = browser
    res, errors, shot = load(pipe, demo_report)
    png = demo_report.parent / "top-1280x800.png"
    png.write_bytes(shot)
    if os.environ.get("MR_SCREENSHOT"):
        shutil.copyfile(png, os.environ["MR_SCREENSHOT"])
    assert res["viewport"] == [WIDTH, HEIGHT], version
    # every figure loaded
    assert len(res["imgs"]) >= 4, res["imgs"]
    for img in res["imgs"]:
        assert img["complete"] and img["w"] > 0 and img["h"] > 0, img
    # nothing on the console at level error, no exception
    assert errors == []
    # the findings, whole, above the fold
    assert res["findings"] is not None, "no 'What this log says' section"
    assert res["scroll"] == 0 and res["findings"]["top"] >= 0
    assert res["findings"]["bottom"] < HEIGHT, res["findings"]
    assert 3 <= len(res["items"]) <= 6
    assert any("k3" in x for x in res["items"]), res["items"]


def test_the_checks_see_a_broken_page(browser, tmp_path):
    """The same checks on a page with a broken image, a console error, a thrown exception and
    the findings pushed below the fold: each is seen."""
    pipe, _ = browser
    page = tmp_path / "broken.html"
    page.write_text(
        '<!DOCTYPE html><html><body><img alt="x" src="data:image/png;base64,AAAA">'
        '<div style="height:900px"></div><section class="findings"><ul><li>k3 1</li></ul>'
        '</section><script>console.error("boom"); throw new Error("bang");</script>'
        "</body></html>",
        encoding="utf-8",
    )
    res, errors, _ = load(pipe, page)
    assert [i["w"] for i in res["imgs"]] == [0]
    assert any("boom" in e for e in errors) and any("bang" in e for e in errors), errors
    assert res["findings"]["bottom"] > HEIGHT
