"""``python -m ampcourse.trial`` (chapter 10): run the command line (``ampcourse.trial.cli``)."""

import sys

from ampcourse.trial.cli import main

sys.exit(main())
