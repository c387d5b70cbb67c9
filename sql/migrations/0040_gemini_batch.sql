-- 0040_gemini_batch: Gemini's Batch API is a hosted batch provider (batch_inference.hosted.gemini_batch).
-- Never edited.

ALTER TABLE bi.hosted_batches DROP CONSTRAINT IF EXISTS hosted_batches_provider_check;
ALTER TABLE bi.hosted_batches ADD CONSTRAINT hosted_batches_provider_check
    CHECK (provider IN ('openai', 'anthropic', 'bedrock', 'gemini'));
