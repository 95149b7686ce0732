"""nbval settings for the study notebooks: compare the printed text, not the pictures.

The notebooks are checked with::

    python -m pytest --nbval notebooks

Figures (plotly JSON), HTML renderings, widget views and images carry random ids and
renderer details that change from run to run, so nbval skips those MIME types; the
text summaries the notebooks print are compared exactly. Cells that print timings are
tagged ``nbval-ignore-output`` in the notebooks themselves. Clock times, memory
addresses, durations and run directories are masked by ``sanitize.cfg`` beside this
file, which is used unless ``--nbval-sanitize-with`` names another.
"""

from pathlib import Path

SKIP_COMPARE = (
    "text/html",
    "application/javascript",
    "application/vnd.plotly.v1+json",
    "application/vnd.jupyter.widget-view+json",
    "application/vnd.jupyter.widget-state+json",
    "image/png",
    "image/jpeg",
    "image/svg+xml",
)
SANITIZE = Path(__file__).with_name("sanitize.cfg")


def pytest_collectstart(collector):
    path = getattr(collector, "path", None)
    if path is None or path.suffix != ".ipynb" or not hasattr(collector, "skip_compare"):
        return
    collector.skip_compare = tuple(collector.skip_compare) + SKIP_COMPARE
    if collector.config.option.nbval_sanitize_with is None:
        collector.config.option.nbval_sanitize_with = str(SANITIZE)
