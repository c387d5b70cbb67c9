"""The ``batch-inference`` commands: each module's ``register(sub)`` adds its subcommands.

``COMMANDS`` is the one list; ``batch-inference --help`` shows the commands
in its order. A new command is a module here and an entry in it.
"""

from batch_inference.commands import (
    capacity,
    chaos,
    cost,
    cutoff,
    database,
    demo,
    estimate,
    fallback,
    jobs,
    ladder,
    nights,
    publish,
    regions,
    review,
    validate,
    worker,
)

COMMANDS = (database, jobs, worker, estimate, capacity, cutoff, cost, validate, ladder, review, publish, chaos, nights, fallback, regions, demo)
