"""``python -m ampcourse.train``: run the command line (``ampcourse.train.cli``) and end the process cleanly."""

from ampcourse.distributed import exit_worker
from ampcourse.train.cli import main

exit_worker(main())
