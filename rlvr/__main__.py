import sys

from rlvr.cli import main

sys.exit(main())
