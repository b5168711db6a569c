"""Time one slider move of every widget: format explorer (ch. 1), range explorer and scaler simulator (ch. 6),
outlier explorer (ch. 9). Target: under 50 ms median.

    .venv/bin/python benchmarks/widget_update.py [--repeats 60]

Same as ``python -m ampcourse.widgets --bench``; record the output in benchmarks/README.md.
"""

import sys

from ampcourse.widgets import _main

if __name__ == "__main__":
    sys.exit(_main(["--bench", *sys.argv[1:]]))
