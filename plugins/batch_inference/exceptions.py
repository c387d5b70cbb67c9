"""The package's exceptions: one base class, and the errors more than one module raises or catches.

Every exception the package raises on purpose derives from
:class:`BatchInferenceError`; its message is one line naming what is wrong,
and the CLI prints it as ``batch-inference COMMAND: error: MESSAGE`` with
exit 2. Each class keeps the builtin base its callers catch it by
(``ValueError`` for a refused input, ``RuntimeError`` for a state, ...).
Errors one module raises and catches itself stay in that module, deriving
from the base: ``ledger.StaleLease``, ``breaker.EndpointUnavailable``,
``ui.actions.Conflict``/``Refused``, ``hooks.batch_inference.LedgerWorkCancelled``,
``schema_sql.Unsupported`` and the worker's ``Fatal``.
"""

from __future__ import annotations


class BatchInferenceError(Exception):
    """Something the package refused or could not do; ``str()`` is one line."""


class InvalidValue(BatchInferenceError, ValueError):
    """An argument, option or bound no computation can run with (a flag, an engine option, a price)."""


# -- the ledger database ------------------------------------------------------

class DatabaseUnavailable(BatchInferenceError, RuntimeError):
    """The database could not be reached after retries."""


class BadDatabaseURL(BatchInferenceError, ValueError):
    """A database URL or conninfo libpq cannot use; the message names it without its password."""


class MigrationRefused(BatchInferenceError, RuntimeError):
    """The database's recorded migrations do not match sql/migrations/; nothing was applied."""


class UnknownJob(BatchInferenceError, LookupError):
    """No job version of that name in the ledger."""


class UnknownDataset(BatchInferenceError, LookupError):
    """No job version of any status was ever submitted for a dataset of that name."""


# -- inputs: the spec and its source ------------------------------------------

class SpecError(BatchInferenceError, ValueError):
    """A spec that cannot be used; the message is one line per problem, each naming its field."""


class SnapshotError(BatchInferenceError, ValueError):
    """The source cannot be snapshotted; one line naming what is wrong."""


# -- the model and where records may go ---------------------------------------

class DigestMismatch(BatchInferenceError, ValueError):
    """The weights on disk are not the weights the spec pins.

    Catching this one class covers every way the pin can fail, so a worker
    refuses to start for all of them with the same exit code.
    """


class WeightsMissing(DigestMismatch):
    """The pinned weights are not there at all (missing, unreadable, none found)."""


class CodeInModel(DigestMismatch):
    """A model directory holds a code file the spec does not declare (``model.code_files``)."""


class NotCleared(BatchInferenceError, ValueError):
    """Records may not go to this endpoint (one line, raised before any request)."""


# -- the stages: grant, validate, publish, fallback ---------------------------

class GrantRefused(BatchInferenceError, ValueError):
    """A grant the ledger refused (no such role, or not a worker role); one line."""


class NotReady(BatchInferenceError, ValueError):
    """The job version still has shards to do (or cannot be validated at all)."""


class PublishRefused(BatchInferenceError, ValueError):
    """A guard refused the publish or rollback; the message is one line."""


class ReviewRefused(BatchInferenceError, ValueError):
    """A review could not be recorded: a bad verdict, or a record outside the version's review sample."""


class RedriveRefused(BatchInferenceError, ValueError):
    """A re-drive of dead letters the ledger refused (a published version, nothing matching, a leased
    shard); one line, nothing changed."""


class BudgetSpent(BatchInferenceError, RuntimeError):
    """``cost.budget`` (``on_budget: page``) pays for no more of a transport's rows: they stay pending, no
    attempt spent (``hosted.budget``; the worker releases its shard and exits). The message is the arithmetic."""


class PointerMoved(PublishRefused):
    """The dataset's pointer is not at the version the caller expected; nothing was changed.

    ``actual`` is the version published now (None: nothing is)."""

    def __init__(self, message: str, *, dataset: str, expected: str | None, actual: str | None):
        super().__init__(message)
        self.dataset, self.expected, self.actual = dataset, expected, actual


class DestinationRefused(PublishRefused):
    """A publish destination refused the version (a removed field, an uncleared record class, a lost race);
    nothing was switched. Not worth a retry."""


class DestinationUnavailable(BatchInferenceError, RuntimeError):
    """A publish destination (its catalog or its object store) could not be reached; nothing was switched.
    Worth a retry."""


class FallbackRefused(BatchInferenceError, ValueError):
    """The fallback may not run as configured (one line, raised before any request)."""


class FallbackIncomplete(BatchInferenceError, RuntimeError):
    """The pool stopped with records still outstanding."""


class FallbackEndpointUnavailable(FallbackIncomplete):
    """The endpoint failed most requests: the pool stopped, records pending, no attempts spent (one line)."""
