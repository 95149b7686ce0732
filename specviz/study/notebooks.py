"""Notebook files: strip per-run noise from executed notebooks, and export them to standalone
HTML pages that draw their plotly figures offline."""

from __future__ import annotations

from pathlib import Path

from specviz.data.store import atomic_write_text

__all__ = ["clean_notebook", "export_html", "notebook_title"]


def clean_notebook(path: str | Path) -> Path:
    """Strip per-run noise from a notebook in place: papermill's notebook and cell
    metadata and execution timestamps. Outputs, tags and execution counts stay.

    Returns:
        The path.
    """
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("papermill", None)
    for cell in nb.cells:
        for key in ("papermill", "execution", "ExecuteTime"):
            cell.metadata.pop(key, None)
    atomic_write_text(path, nbformat.writes(nb) + "\n")
    return path


def _inline_plotly(nb) -> None:
    """Give every plotly output an HTML rendering, plotly.js inlined once (no CDN)."""
    import plotly.io as pio

    first = True
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            fig = data.get("application/vnd.plotly.v1+json")
            if fig is None or "text/html" in data:
                continue
            data["text/html"] = pio.to_html(dict(fig), include_plotlyjs=first, full_html=False,
                                            config={"displaylogo": False})
            first = False


# The lab template loads require.js from a CDN; with it present, the inlined plotly.js would
# register itself as an anonymous AMD module instead of defining window.Plotly.
_NO_REQUIREJS_TEMPLATE = (
    "{%- extends 'lab/index.html.j2' -%}\n"
    "{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}\n"
)


def notebook_title(nb) -> str | None:
    """The text of a notebook's first level-1 Markdown heading (``# 03 · Chain vs tree``),
    or None when it has none."""
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        for line in str(cell.source).splitlines():
            if line.startswith("# "):
                return line[2:].strip() or None
    return None


def export_html(notebook: str | Path, dest: str | Path, *, hide_code: bool = False, title: str | None = None) -> Path:
    """Export an executed notebook to one standalone HTML file that works offline.

    Args:
        notebook: the executed ``.ipynb``.
        dest: the ``.html`` file to write (atomically).
        hide_code: leave code cells out (for the report).
        title: the page's ``<title>`` (default: the notebook's first ``#`` heading,
            else its file name).
    """
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(Path(notebook), as_version=4)
    _inline_plotly(nb)
    exporter = HTMLExporter(
        extra_loaders=[jinja2.DictLoader({"specviz_offline.html.j2": _NO_REQUIREJS_TEMPLATE})],
        template_file="specviz_offline.html.j2",
    )
    exporter.exclude_input = hide_code
    exporter.exclude_input_prompt = hide_code
    exporter.exclude_output_prompt = hide_code
    name = title or notebook_title(nb) or Path(notebook).stem
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": name}})
    return atomic_write_text(dest, body)
