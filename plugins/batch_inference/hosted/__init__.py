"""Hosted batch transports: a provider's batch API as a worker on the same ledger.

``core`` holds what every provider shares (intents, polling with the count
mirror, cancel-and-collect, reconciliation); one module per provider speaks its
API through the official client: ``openai_batch`` (OpenAI Batch API),
``anthropic_batch`` (Anthropic Message Batches), ``bedrock_batch`` (Amazon
Bedrock batch inference), ``gemini_batch`` (Gemini's Batch API). ``counts`` is the cutoff's hosted term.
"""
