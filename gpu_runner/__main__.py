"""``python -m gpu_runner JOB_VERSION [options]``: the worker, as in the container."""

import sys

from gpu_runner.worker import main

sys.exit(main())
