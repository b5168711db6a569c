"""``python -m ampcourse.plan``: see :mod:`ampcourse.plan.cli`."""

import sys

from ampcourse.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
