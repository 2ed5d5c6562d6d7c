"""`python -m benchmarks`: the CPU benchmark, or with `--device cuda` the GPU one (benchmarks/cpu.py)."""

from __future__ import annotations

import argparse

from . import cpu
from .cpu import add_arguments, run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=cpu.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
