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
* publish (``embed.index``): ``SearchIndex``, the destination that builds a
  version's pgvector search table and HNSW index before the pointer moves,
  and ``ensure_view``, the dataset's view over it.

Snapshot, shards, leases, epochs, put-if-absent, dead letters, incremental
runs, the cutoff and the autopilot are the answers' own, unchanged.
"""

from __future__ import annotations

from batch_inference.embed.checks import drift, recall, scan
from batch_inference.embed.vectors import from_storage, to_storage

__all__ = ["check_spec", "drift", "drop_search_table", "embed_input", "ensure_view", "from_storage", "recall", "scan", "search_index",
           "to_storage"]


def check_spec(spec) -> None:
    """At submit (``plan.submit``): an embedding spec's model must make ``embedding.dimensions``-sized vectors."""
    from batch_inference.embed.engines import check_spec as check

    check(spec)


def embed_input(spec, text: str) -> str:
    """The text an engine embeds for one record."""
    from batch_inference.embed.engines import embed_input as render

    return render(spec, text)


def search_index(spec, conn):
    """The publish destination of an embedding spec (``destinations.for_spec``)."""
    from batch_inference.embed.index import SearchIndex

    return SearchIndex(spec, ledger=conn)


def drop_search_table(conn, job_version: str) -> None:
    """Drop a version's search table, if it has one (``plan.drop_job_version``)."""
    from psycopg import sql

    from batch_inference.db import composed

    conn.execute(composed("embed_index_drop", table=sql.Identifier("bi", f"embed_{job_version}")))


def ensure_view(conn, dataset: str, spec, job_version: str, id_type: str) -> str:
    """The dataset's view over ``job_version``'s search table (``destinations.view.ensure_view``)."""
    from batch_inference.embed.index import ensure_view as ensure

    return ensure(conn, dataset, spec, job_version, id_type)
