"""``python -m ampcourse.widgets``: see :mod:`ampcourse.widgets.cli` (chapters 1, 6 and 9's widgets, timed)."""

import sys

from ampcourse.widgets.cli import main

if __name__ == "__main__":
    sys.exit(main())
