"""``python -m tessera_jax demo``: the main job (``tessera_jax/train/demo.py``)."""

from __future__ import annotations

import argparse
import sys

from tessera_jax.train import demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tessera_jax")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="train a small transformer built from ts operators, deterministically",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(d)
    args = parser.parse_args(argv)
    try:
        demo.run(args)
    except ValueError as e:
        parser.exit(2, f"python -m tessera_jax {args.command}: error: {e}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
