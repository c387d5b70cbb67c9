"""What the harnesses share: the pieces the chaos run (``batch_inference.chaos``), the nights
(``batch_inference.nights``) and the tests build their runs from, under public names.

* ``database``: a restartable embedded PostgreSQL (``EmbeddedServer``) whose data directory starts
  as a copy of one initialized once (``initialized_data``), the harness's own connection that
  reconnects across restarts (``Admin``), and worker credentials for one job (``worker_credentials``);
* ``source``: the seeded source table with poison records (``make_source``);
* ``loopback``: a server on 127.0.0.1 speaking OpenAI's chat-completions wire shape
  (``ChatServer``), the fallback endpoint of the nights and the tests;
* ``hosted_sim`` and ``hosted_openai``: a hosted batch provider's clock (``BatchProvider``) and a
  loopback emulator of OpenAI's Batch API on it (``OpenAIBatchEmulator``), the hosted nights'
  provider and the hosted transport tests'; ``hosted_gemini``: the same for Gemini's Batch API
  (``GeminiBatchEmulator``).

A harness imports from here, never another harness's private names.
"""

from batch_inference.harness.database import Admin, EmbeddedServer, initialized_data, worker_credentials
from batch_inference.harness.hosted_gemini import GeminiBatchEmulator
from batch_inference.harness.hosted_openai import OpenAIBatchEmulator
from batch_inference.harness.hosted_sim import BatchProvider
from batch_inference.harness.loopback import DROP, ChatServer, completion
from batch_inference.harness.source import SOURCE, make_source

__all__ = ["DROP", "SOURCE", "Admin", "BatchProvider", "ChatServer", "EmbeddedServer", "GeminiBatchEmulator",
           "OpenAIBatchEmulator", "completion", "initialized_data", "make_source", "worker_credentials"]
