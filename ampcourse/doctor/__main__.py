"""``python -m ampcourse.doctor``: see :mod:`ampcourse.doctor.cli`."""

import sys

from ampcourse.doctor.cli import main

if __name__ == "__main__":
    sys.exit(main())
