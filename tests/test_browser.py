"""The explorer notebook in a real JupyterLab, driven by headless Chromium.

Starts JupyterLab on 127.0.0.1 with a throwaway configuration (temporary config,
data, runtime and workspace directories; the widget and plotly lab extensions still
come from the environment's ``share/jupyter``), opens ``notebooks/07_explorer.ipynb``
(a copy, so the repository file is never rewritten) and runs it with the tiny model on
a 128-node dynamic tree (parameters set in a cell added after the parameters cell:
width 8, depth 3, budget 128), plus one added cell that draws a tree whose token and
title hold quotes and a tag. The test checks that

* the 128-node tree fits: the figure's SVG and every node marker and label lie inside
  the output area, which is no wider than the page;
* pressing ArrowRight on the depth slider redraws the tree;
* no drawn text (SVG text of the tree, step and added figures) holds ``&quot;``, and the
  quotes and the tag of the added figure are drawn as characters;
* the browser console has no plotly colour warnings.

A screenshot goes to ``outputs/explorer.png``. The server and its kernels are shut
down whatever happens.

Needs Debian's ``chromium`` (or ``$SPECVIZ_CHROMIUM``) and the ``playwright`` package;
without them the test is skipped, except under ``CI=true`` where that is a failure.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from specviz.locations import NOTEBOOKS_DIR, outputs_dir

pytestmark = pytest.mark.browser

NOTEBOOK = "07_explorer.ipynb"
#: the explorer's settings in the test: the tiny model drawing 128-node dynamic trees
#: (EAGLE-2 keeps ``width + (depth - 1) * width ** 2`` = 136 candidates at width 8, depth 3)
EXPLORER_PARAMETERS = dict(model="tiny", strategy="dynamic", width=8, depth=3, budget=128)
#: a token and a title with quotes and a tag, drawn by an added cell
QUOTED = 'say "hi" <b>'
QUOTE_CELL = f"""\
from specviz.render import figure_mimebundle, tree_figure
from specviz.tree.core import DraftTree
from IPython.display import display


class QuoteTokenizer:
    def decode(self, ids):
        return {QUOTED!r}


quoted = tree_figure(DraftTree.from_lists([1, 2, 3], [-1, 0, 1]), tokenizer=QuoteTokenizer(),
                     title={("title " + QUOTED)!r})
display(figure_mimebundle(quoted), raw=True)
"""
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SERVER_START_S = 180
NOTEBOOK_RUN_S = 300
UPDATE_S = 180


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but the browser test cannot run: {reason}")
    pytest.skip(reason)


def _chromium() -> str:
    path = os.environ.get("SPECVIZ_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(path, os.X_OK):
        _unavailable(f"no Chromium at {path} (Debian: apt-get install chromium)")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, token: str, path: str, method: str = "GET"):
    req = urllib.request.Request(f"{base}{path}", method=method,
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = resp.read()
    return json.loads(body) if body else None


def _stop_server(proc: subprocess.Popen, base: str, token: str) -> None:
    """Shut kernels and server down through the REST API, then make sure the server's
    process group is gone."""
    try:
        for kernel in _api(base, token, "/api/kernels"):
            _api(base, token, f"/api/kernels/{kernel['id']}", method="DELETE")
        _api(base, token, "/api/shutdown", method="POST")
    except (urllib.error.URLError, OSError):
        pass  # the server may already be down; the signals below finish the job
    for sig, wait_s in ((None, 20), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        if sig is not None and proc.poll() is None:
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue


def _prepare_notebook(src: Path, dest: Path) -> None:
    """Copy the explorer notebook with the test's settings in a cell after the parameters
    cell (as papermill injects them) and the quote cell at the end; outputs are dropped."""
    nb = json.loads(src.read_text(encoding="utf-8"))
    cells = nb["cells"]
    at = next((i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    assert at is not None, f"{src.name} has no cell tagged 'parameters'"

    def code(cell_id: str, source: str) -> dict:
        return {"cell_type": "code", "execution_count": None, "id": cell_id, "metadata": {}, "outputs": [],
                "source": source.splitlines(keepends=True)}

    settings = "\n".join(f"{k} = {v!r}" for k, v in EXPLORER_PARAMETERS.items())
    cells.insert(at + 1, code("test-settings", settings))
    cells.append(code("test-quotes", QUOTE_CELL))
    for c in cells:
        if c["cell_type"] == "code":
            c["outputs"], c["execution_count"] = [], None
    dest.write_text(json.dumps(nb, indent=1), encoding="utf-8")


@pytest.fixture
def jupyter_lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 serving a copy of the explorer notebook.

    Yields ``(base_url, token)``.
    """
    root = tmp_path / "root"
    root.mkdir()
    _prepare_notebook(NOTEBOOKS_DIR / NOTEBOOK, root / NOTEBOOK)
    config = tmp_path / "config"
    # no news or update checks: the machine may be offline, and popups cover the page
    settings = config / "lab" / "user-settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    (config / "jupyter_lab_config.json").write_text(json.dumps({"LabApp": {
        "news_url": None, "check_for_updates_class": "jupyterlab.NeverCheckForUpdate",
        "extension_manager": "readonly"}}))
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(config),
        JUPYTER_DATA_DIR=str(tmp_path / "data"),  # the environment's share/jupyter is still searched
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        IPYTHONDIR=str(tmp_path / "ipython"),
        JUPYTER_PLATFORM_DIRS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(NOTEBOOKS_DIR.parent), env.get("PYTHONPATH")])),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    # The tiny model needs no thread pool, and on a shared 2-core machine an oversubscribed
    # one makes each tiny forward pass ~100x slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    port, token = _free_port(), secrets.token_hex(16)
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "jupyterlab.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={root}", f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
           "--LabApp.expose_app_in_browser=True", "--ServerApp.allow_remote_access=False",
           "--ServerApp.terminals_enabled=False", "--allow-root"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                _api(base, token, "/api/status")
                break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s:\n"
                                f"{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
        yield base, token
    finally:
        _stop_server(proc, base, token)
    assert proc.poll() is not None, "JupyterLab is still running after shutdown"


@pytest.fixture
def page():
    """A headless Chromium page (only loopback traffic is expected); its console messages
    are collected in ``page.console_messages``."""
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as err:
        _unavailable(f"the playwright package is missing ({err})")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport={"width": VIEWPORT_WIDTH, "height": 2400})
            new_page = context.new_page()
            new_page.console_messages = []
            new_page.on("console", lambda m: new_page.console_messages.append(f"{m.type}: {m.text}"))
            yield new_page
        finally:
            browser.close()


VIEWPORT_WIDTH = 1400
TREE_POINTS = ".specviz-tree .js-plotly-plot .scatterlayer path.point"
TREE_TITLE = ".specviz-tree .js-plotly-plot .gtitle"
#: plotly.js's warning for a colour it cannot read ("WARN: Invalid color specifier: ...")
COLOR_WARNING = re.compile(r"invalid colou?r|colou?r specifier", re.IGNORECASE)

# Boxes of the first tree figure's output area, SVG, node markers and labels (page px).
_TREE_BOXES_JS = """() => {
    const area = document.querySelector('.specviz-tree');
    const plot = area.querySelector('.js-plotly-plot');
    const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.right, r.width]; };
    const labels = [...plot.querySelectorAll('.scatterlayer .textpoint text')].filter(t => t.textContent);
    return {area: box(area), scroll: [area.scrollWidth, area.clientWidth],
            svg: box(plot.querySelector('svg.main-svg')),
            points: [...plot.querySelectorAll('.scatterlayer path.point')].map(box),
            labels: labels.map(box)};
}"""

# Text content of every SVG text element of the explorer's figures and of the added cell.
_DRAWN_TEXT_JS = """() => [...document.querySelectorAll('.js-plotly-plot svg text')].map(t => t.textContent)"""


def _check_tree_fits(page) -> int:
    """Assert the drawn tree lies inside its output area and the page; the marker count."""
    boxes = page.evaluate(_TREE_BOXES_JS)
    left, right, width = boxes["area"]
    assert right <= VIEWPORT_WIDTH + 1, f"the output area ends at {right:.0f} px, past the page"
    scroll_width, client_width = boxes["scroll"]
    assert scroll_width <= client_width + 1, f"the tree output scrolls sideways ({scroll_width} > {client_width})"
    s_left, s_right, s_width = boxes["svg"]
    assert left - 1 <= s_left and s_right <= right + 1, f"the figure {boxes['svg']} leaves the area {boxes['area']}"
    assert s_width >= 0.9 * width, f"the figure ({s_width:.0f} px) does not fill its area ({width:.0f} px)"
    for kind in ("points", "labels"):
        outside = [b for b in boxes[kind] if b[0] < s_left - 1 or b[1] > s_right + 1]
        assert not outside, f"{len(outside)} {kind} lie outside the figure {boxes['svg']}: {outside[:3]}"
    return len(boxes["points"])


def test_explorer_depth_slider_redraws_tree(page, jupyter_lab):
    base, token = jupyter_lab
    started = time.monotonic()
    page.set_default_timeout(60_000)
    page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}", wait_until="domcontentloaded")
    page.wait_for_function(
        "() => window.jupyterapp && window.jupyterapp.shell.currentWidget"
        " && window.jupyterapp.shell.currentWidget.context"
        " && window.jupyterapp.shell.currentWidget.sessionContext.session"
        " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
        timeout=SERVER_START_S * 1000)
    page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.ready")
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")

    page.wait_for_selector(TREE_POINTS, timeout=NOTEBOOK_RUN_S * 1000)
    title_before = page.locator(TREE_TITLE).text_content()
    subtitle = page.locator(".specviz-tree .js-plotly-plot .gtitle-subtitle").first.text_content()
    assert "128 draft nodes" in subtitle, f"expected the 128-node tree, got the subtitle {subtitle!r}"
    before = _check_tree_fits(page)
    assert before >= 2, f"the first tree should show the root and more, got {before} markers"

    label = page.locator(".widget-label", has_text=re.compile(r"^depth$"))
    depth = page.locator(".widget-hslider", has=label)
    handle = depth.locator(".noUi-handle")
    readout = depth.locator(".widget-readout")
    value_before = int(readout.inner_text())
    handle.focus()
    handle.press("ArrowRight")
    page.wait_for_function(
        "([sel, n]) => document.querySelectorAll(sel).length !== n",
        arg=[TREE_POINTS, before], timeout=UPDATE_S * 1000)
    page.wait_for_selector(TREE_POINTS)
    after = page.locator(TREE_POINTS).count()
    assert int(readout.inner_text()) == value_before + 1
    assert after != before
    assert page.locator(TREE_TITLE).text_content() != title_before

    _check_tree_fits(page)

    # the added cell's figure: quotes and the tag drawn as characters, nowhere an entity
    quoted_title = page.locator(".js-plotly-plot .gtitle", has_text="title say")
    quoted_title.wait_for(timeout=NOTEBOOK_RUN_S * 1000)
    assert quoted_title.text_content() == "title " + QUOTED
    drawn = page.evaluate(_DRAWN_TEXT_JS)
    assert any('"hi"' in t for t in drawn if t != "title " + QUOTED), "the quoted label is not drawn"
    entities = [t for t in drawn if re.search(r"&(quot|#x27|#39|#34|lt|gt|amp);", t)]
    assert not entities, f"drawn text shows HTML entities: {entities[:5]}"

    warnings = [m for m in page.console_messages if COLOR_WARNING.search(m)]
    assert not warnings, f"plotly colour warnings in the console: {warnings[:5]}"

    shot = outputs_dir() / "explorer.png"
    page.locator(".specviz-explorer").screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
    print(f"markers {before} -> {after}; {time.monotonic() - started:.1f} s in the browser; "
          f"screenshot {shot}")
