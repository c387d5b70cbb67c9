"""``python -m gpu_runner JOB_VERSION [options]``: the worker, as in the container."""

import gc
import sys

# What the imports make lives until exit: no collection walks it while it piles up. The worker turns
# the collector on before its engine loads the model, and freezes what is there once it has (Worker._run).
gc.disable()
from gpu_runner.worker import main  # noqa: E402

sys.exit(main())
