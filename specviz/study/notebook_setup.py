"""The first code cell of every study notebook: :func:`setup_notebook`.

It seeds, sets the presentation defaults that make the executed notebooks reproducible
(and comparable by nbval), and optionally fixes torch's threads. Importable from
:mod:`specviz.study.runner` too, as the notebooks do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specviz.validate import check_int

if TYPE_CHECKING:
    import torch

__all__ = ["setup_notebook"]


def setup_notebook(seed: int, *, threads: int | None = None) -> torch.Generator:
    """The first code cell of every study notebook: seed, presentation defaults, threads.

    Seeds torch's global generator (for library code that falls back on it), prints
    floats with 3 decimals (pandas and torch), sends plotly figures as plotly's own
    MIME type (JupyterLab draws them; :func:`export_html` turns them into offline
    HTML), turns off transformers' progress bars (a model load would otherwise leave a
    widget whose text changes every run) and optionally fixes the number of CPU
    threads torch uses.

    Args:
        seed: the notebook's seed.
        threads: torch intra-op threads; None leaves torch's choice.

    Returns:
        A CPU ``torch.Generator`` seeded with ``seed``, for the notebook's own sampling.
    """
    import pandas as pd
    import plotly.io as pio
    import torch
    from transformers.utils import logging as transformers_logging

    from specviz.sampling import make_generator

    if threads is not None:
        torch.set_num_threads(check_int("threads", threads, note="or None"))
    torch.manual_seed(seed)
    torch.set_printoptions(precision=3, sci_mode=False)
    pd.set_option("display.precision", 3)
    pd.set_option("display.width", 120)
    pd.set_option("display.max_columns", 30)
    pio.renderers.default = "plotly_mimetype"
    transformers_logging.disable_progress_bar()
    return make_generator(seed)
