"""``python -m rlvr`` and the ``rlvr`` command: the allocator first (platform/allocator.py; before torch), then the
CLI."""

import sys

from rlvr.platform.allocator import preload_and_restart

RUNS = ("train", "eval", "serve")  # the commands that train or generate: they get the leaner allocator


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in RUNS:
        preload_and_restart()
    from rlvr.cli import main as cli_main

    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
