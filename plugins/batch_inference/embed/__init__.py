"""Embedding jobs: a spec's ``task: embed`` (one vector per record), on the same ledger as answers.

The one interface of the pieces an embedding job adds to the flow (docs/embeddings.md):

* the engines' embedding modes (``embed.engines``: llama.cpp, vLLM's pooling
  runner, an OpenAI-compatible ``/embeddings``, the OpenAI Batch API's
  ``/v1/embeddings`` as a hosted transport), which ``engines.load_engine``
  gives an embedding spec, and ``check_spec``, which refuses at submit a
  model whose size is not ``embedding.dimensions``;
* the stored form (``embed.vectors``): float32 bytes in
  ``bi.results.embedding``, checked by the worker before it stores them;
* the validator's checks (``embed.checks``): ``scan``, ``drift``, ``recall``;
* publish: ``destinations.search_index.SearchIndex``, the destination that
  builds a version's pgvector search table and HNSW index before the pointer
  moves, and its ``ensure_view``, the dataset's view over it (a destination
  beside the others; ``drop_search_table`` here drops a version's table).

Snapshot, shards, leases, epochs, put-if-absent, dead letters, incremental
runs, the cutoff and the autopilot are the answers' own, unchanged.
"""

from __future__ import annotations

from batch_inference.embed.checks import drift, recall, scan
from batch_inference.embed.vectors import DTYPE, from_storage, to_storage

__all__ = ["DTYPE", "check_spec", "drift", "drop_search_table", "embed_input", "from_storage", "recall", "scan",
           "to_storage"]


def check_spec(spec) -> None:
    """At submit (``plan.submit``): an embedding spec's model must make ``embedding.dimensions``-sized vectors."""
    from batch_inference.embed.engines import check_spec as check

    check(spec)


def embed_input(spec, text: str) -> str:
    """The text an engine embeds for one record."""
    from batch_inference.embed.engines import embed_input as render

    return render(spec, text)


def drop_search_table(conn, job_version: str) -> None:
    """Drop a version's search table, if it has one (``plan.drop_job_version``)."""
    from psycopg import sql

    from batch_inference.db import composed

    conn.execute(composed("embed_index_drop", table=sql.Identifier("bi", f"embed_{job_version}")))
