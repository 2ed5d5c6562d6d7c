"""`python -m benchmarks`: one model pushed with window 1 and window 4 in one run; says which is faster."""

from __future__ import annotations

import argparse

from .cpu import add_arguments, run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    add_arguments(ap)
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
