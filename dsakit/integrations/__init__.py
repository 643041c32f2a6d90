"""Integrations with model libraries (imported on demand: ``dsakit.integrations.transformers`` needs
transformers with DeepSeek-V4, a test-only dependency of dsakit)."""
