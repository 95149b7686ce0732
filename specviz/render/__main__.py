"""``python -m specviz.render --readme-figure``: draw the README's picture."""

from __future__ import annotations

import argparse
from typing import Sequence

from specviz.render.export import README_FIGURE, save_example_tree


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m specviz.render --readme-figure [--model builtin|tiny] [--out PATH]``."""
    from specviz.models.tiny import tiny_pair

    parser = argparse.ArgumentParser(
        prog="python -m specviz.render",
        description="Draw the README's picture: one verification step of a 2-2-1-1 draft tree.")
    parser.add_argument("--readme-figure", action="store_true", required=True,
                        help="draw one verification step of the built-in pair as the README picture")
    parser.add_argument("--model", choices=("builtin", "tiny"), default="builtin",
                        help="model pair (tiny: random weights, for a quick check)")
    parser.add_argument("--out", default=README_FIGURE, help="PNG path (relative: under outputs/)")
    args = parser.parse_args(argv)
    pair = tiny_pair() if args.model == "tiny" else None
    print(save_example_tree(args.out, pair))


if __name__ == "__main__":
    main()
