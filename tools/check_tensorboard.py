"""Check in a real headless browser that TensorBoard shows a training run's scalars, step
timelines and traces.

    python -m tools.check_tensorboard --logdir outputs/debug_paro [--screenshot-dir outputs/tb_check]

Why: "the logs are written" is not "a user sees them". This starts TensorBoard on the trainer's
dump folder, asks its HTTP API which runs, scalar tags and images it found, then loads the pages
in headless Chromium (Debian's ``chromium`` package) and checks what they render:
- the Time Series dashboard (plain DOM, read with ``--dump-dom``, filtered to the trainer's
  scalar tags because it renders cards lazily) names the trainer's scalar tags;
- the Images tab shows every rank's ``timeline/rank<r>`` image (``profiling.timeline``): its
  cards live in shadow roots, which ``--dump-dom`` does not serialise, so Chromium is driven over
  the DevTools protocol on a pipe (``--remote-debugging-pipe``) and a script walks the shadow
  roots for image elements that loaded (``naturalWidth > 0``);
- every ``*.pt.trace.json`` parses as a Chrome trace with events, and, when the torch-tb-profiler
  plugin is importable, its backend lists the trace run and whether its page renders (offline it
  cannot: see the note in the code; traces then open in Perfetto or chrome://tracing).
With ``--screenshot-dir`` it saves PNG screenshots to look at (scalars, timeseries, images,
timeline_cards, profiler).

Exit status 0 when the scalars and timeline images render (and the traces are valid); 1
otherwise; 2 when Chromium or TensorBoard is missing. Pass extra Python paths for plugins with
``--plugin-path``.
"""
from __future__ import annotations

import argparse
import base64
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Any, Optional

SCALAR_TAGS = ("loss/train", "optim/grad_norm", "optim/lr", "throughput/tokens_per_s", "comm/inter_MiB_per_step")
TIMELINE = "timeline/"
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage")

# Every <img> of the page, inside shadow roots too, with the tag and run of the element whose
# shadow root holds it (TensorBoard's tf-image-loader), and whether it decoded.
_IMAGES_JS = r"""(() => { const out = [];
  const walk = (root) => { for (const el of root.querySelectorAll('*')) {
      if (el.tagName === 'IMG') { const h = el.getRootNode().host;
        out.push({tag: h && h.tag || null, run: h && h.run || null, width: el.naturalWidth, done: el.complete}); }
      if (el.shadowRoot) walk(el.shadowRoot); } };
  walk(document); return out; })()"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read().decode())


def find_chromium() -> Optional[str]:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def render(chromium: str, url: str, screenshot: Optional[str] = None, budget_ms: int = 20000) -> str:
    """The DOM of ``url`` after its scripts ran for ``budget_ms`` of virtual time."""
    with tempfile.TemporaryDirectory() as profile:
        base = [
            chromium,
            *FLAGS,
            f"--user-data-dir={profile}",
            "--window-size=1600,1200",
            f"--virtual-time-budget={budget_ms}",
        ]
        dom = subprocess.run(base + ["--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
        if screenshot:
            subprocess.run(base + [f"--screenshot={screenshot}", url], capture_output=True, timeout=180)
    return dom


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe: Chromium reads commands on
    its fd 3 and writes replies on fd 4, each a JSON message ended by a NUL byte."""

    def __init__(self, binary: str, width: int = 1600, height: int = 1200) -> None:
        self.profile = tempfile.TemporaryDirectory()
        cmd_r, self._cmd_w = os.pipe()
        self._reply_r, reply_w = os.pipe()

        def to_fds_3_and_4() -> None:  # in the child; dup first, so neither dup2 clobbers the other
            a, b = os.dup(cmd_r), os.dup(reply_w)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={self.profile.name}", f"--window-size={width},{height}",
             "--remote-debugging-pipe", "about:blank"],
            preexec_fn=to_fds_3_and_4, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(reply_w)
        self._buf, self._id = b"", 0

    def send(
        self, method: str, params: Optional[dict] = None, session: Optional[str] = None, timeout: float = 60
    ) -> dict:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:  # events and other replies are skipped
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            if time.monotonic() > deadline:
                raise TimeoutError(f"chromium did not answer {method} in {timeout} s")
            chunk = os.read(self._reply_r, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self._buf += chunk

    def open(self, url: str) -> str:
        """A new tab on ``url``; returns its session."""
        target = self.send("Target.createTarget", {"url": url})["targetId"]
        return self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def evaluate(self, session: str, expression: str) -> Any:
        r = self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}, session
        )
        return r.get("result", {}).get("value")

    def screenshot(self, session: str, path: str) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png"}, session)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._cmd_w)
        os.close(self._reply_r)
        self.profile.cleanup()


def _rendered(html: str) -> str:
    """The rendered DOM without inline scripts and styles (a bundle's strings are not rendered).
    Attributes stay: TensorBoard puts a card's full tag in its ``title`` and splits the text."""
    return re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S | re.I)


def check_traces(logdir: str) -> list[str]:
    problems = []
    traces = sorted(glob.glob(os.path.join(logdir, "**", "*.pt.trace.json"), recursive=True))
    if not traces:
        return ["no *.pt.trace.json under the logdir (was [profiling] enable_profiling on?)"]
    for path in traces:
        try:
            with open(path) as f:
                data = json.load(f)
            events = data.get("traceEvents", [])
            if not events:
                problems.append(f"{path}: no traceEvents")
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: not a JSON trace ({exc})")
    print(f"traces: {len(traces)} *.pt.trace.json files parse as Chrome traces" if not problems else "traces: PROBLEMS")
    return problems


def check_timeline_images(chromium: str, base: str, screenshot_dir: Optional[str], budget_ms: int) -> list[str]:
    """The Images tab shows every timeline image TensorBoard's backend found, decoded."""
    listing = _get_json(f"{base}/data/plugin/images/tags")
    want = sorted((run, tag) for run, tags in listing.items() for tag in tags if tag.startswith(TIMELINE))
    print(f"backend: timeline images {[f'{run}:{tag}' for run, tag in want]}")
    if not want:
        return ["TensorBoard found no timeline/rank<r> image (needs profiling.enable_profiling, profiling.timeline "
                "and metrics.enable_tensorboard)"]
    browser = Chromium(chromium)
    try:
        tab = browser.open(f"{base}/#images")
        seen: list[dict] = []
        deadline = time.monotonic() + budget_ms / 1e3
        while time.monotonic() < deadline:
            time.sleep(1)
            seen = [i for i in browser.evaluate(tab, _IMAGES_JS) or [] if (i["tag"] or "").startswith(TIMELINE)]
            if {(i["run"], i["tag"]) for i in seen if i["done"] and i["width"] > 0} >= set(want):
                break
        shown = sorted({(i["run"], i["tag"]) for i in seen if i["done"] and i["width"] > 0})
        widths = sorted({i["width"] for i in seen})
        if screenshot_dir:
            browser.screenshot(tab, os.path.join(screenshot_dir, "images.png"))
            cards = browser.open(f"{base}/?tagFilter={urllib.parse.quote('^timeline/rank')}#timeseries")
            time.sleep(min(budget_ms / 1e3, 10))
            browser.screenshot(cards, os.path.join(screenshot_dir, "timeline_cards.png"))
    finally:
        browser.close()
    print(f"browser: the Images tab shows {len(shown)} of {len(want)} timeline images decoded (widths {widths} px)")
    missing = sorted(set(want) - set(shown))
    return [f"the Images tab does not show the timeline image {tag} of run {run}" for run, tag in missing]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--logdir", required=True, help="the trainer's job.dump_folder")
    ap.add_argument("--screenshot-dir", default=None)
    ap.add_argument(
        "--plugin-path", default=None, help="extra sys.path entries (os.pathsep-separated) for TensorBoard plugins"
    )
    ap.add_argument("--budget-ms", type=int, default=20000, help="virtual time for the page's scripts")
    a = ap.parse_args(argv)

    chromium = find_chromium()
    if chromium is None:
        print("check_tensorboard: no chromium on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    port = _free_port()
    env = dict(os.environ)
    if a.plugin_path:
        env["PYTHONPATH"] = a.plugin_path + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", a.logdir, "--port", str(port), "--host", "127.0.0.1"]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    tb = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    problems: list[str] = []
    try:
        for _ in range(120):
            try:
                _get_json(f"{base}/data/environment")
                break
            except OSError:
                if tb.poll() is not None:
                    log.seek(0)
                    print(f"check_tensorboard: tensorboard exited:\n{log.read()[-2000:]}", file=sys.stderr)
                    return 2
                time.sleep(0.5)
        # 1. what TensorBoard's backend found
        tags = {}
        for _ in range(60):  # the first load of the event files is asynchronous
            tags = _get_json(f"{base}/data/plugin/scalars/tags")
            if tags:
                break
            time.sleep(1)
        runs_with_loss = [run for run, t in tags.items() if "loss/train" in t]
        print(f"backend: runs {sorted(tags)}; runs with loss/train: {runs_with_loss}")
        if not runs_with_loss:
            problems.append("TensorBoard found no run with the loss/train scalar")
        plugins = _get_json(f"{base}/data/plugins_listing")
        active = sorted(k for k, v in plugins.items() if v.get("enabled"))
        print(f"backend: active plugins {active}")

        # 2. what a browser shows. The Time Series dashboard is plain DOM (the Scalars one lives in
        # shadow roots, which --dump-dom does not serialise); it renders cards lazily, so the page
        # is filtered to the trainer's tags (its tagFilter URL parameter), the loss card is
        # required and the others are reported.
        shot = None
        if a.screenshot_dir:
            os.makedirs(a.screenshot_dir, exist_ok=True)
            render(chromium, f"{base}/#scalars", os.path.join(a.screenshot_dir, "scalars.png"), a.budget_ms)
            shot = os.path.join(a.screenshot_dir, "timeseries.png")
        only = urllib.parse.quote("^(" + "|".join(re.escape(t) for t in SCALAR_TAGS) + ")$")
        dom = render(chromium, f"{base}/?tagFilter={only}#timeseries", shot, a.budget_ms)
        seen = [t for t in SCALAR_TAGS if t in _rendered(dom)]
        print(f"browser: the Time Series dashboard shows cards for {seen}"
              + (f"; screenshots in {a.screenshot_dir}" if a.screenshot_dir else ""))
        if "loss/train" not in seen:
            problems.append("the rendered Time Series dashboard has no loss/train card")

        # 3. the step timelines (profiling.timeline) and the traces they were drawn from
        traces = check_traces(a.logdir)
        problems += traces
        if not traces:  # traces were written: each rank's timeline image should show
            problems += check_timeline_images(chromium, base, a.screenshot_dir, a.budget_ms)
        if "pytorch_profiler" in plugins:
            runs: Any = {"loading": True}
            for _ in range(300):  # the plugin parses the traces in the background
                runs = _get_json(f"{base}/data/plugin/pytorch_profiler/runs")
                if not runs.get("loading"):
                    break
                time.sleep(1)
            names = runs.get("runs", [])
            spans = _get_json(f"{base}/data/plugin/pytorch_profiler/spans?run={names[0]}&worker=rank0") if names else []
            print(f"profiler plugin backend: runs {names}, spans of rank0 {spans}")
            if not names:
                problems.append("the PyTorch Profiler plugin found no trace run")
            shot = os.path.join(a.screenshot_dir, "profiler.png") if a.screenshot_dir else None
            # the plugin's page is an iframe inside TensorBoard: load it directly to read its DOM
            dom = _rendered(render(chromium, f"{base}/data/plugin/pytorch_profiler/index.html", shot, a.budget_ms))
            rendered = "Step Time Breakdown" in dom or "Execution Summary" in dom
            # Informational, not a failure: torch-tb-profiler 0.4.3 draws its Overview with Google
            # Charts fetched from the internet ("google is not defined" offline) and its Trace view
            # relies on HTML Imports, which current Chromium removed; the traces are plain Chrome
            # trace JSON, viewable in Perfetto or chrome://tracing, and drawn per step in the
            # Images tab (timeline/rank<r>).
            seen = "renders its overview" if rendered else (
                "shows its run/worker/span selectors but not its charts "
                "(needs internet Google Charts; Trace view needs HTML Imports)")
            print(f"browser: PyTorch Profiler page {seen}" + (f"; screenshot {shot}" if shot else ""))
        else:
            print("profiler plugin: not installed (torch-tb-profiler); traces are drawn per step in the Images tab "
                  "(timeline/rank<r>) and open in Perfetto or chrome://tracing")
    finally:
        tb.terminate()
        try:
            tb.wait(timeout=10)
        except subprocess.TimeoutExpired:
            tb.kill()
        log.close()
        os.unlink(log.name)
    for p in problems:
        print(f"PROBLEM: {p}")
    print("OK" if not problems else "FAILED")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
