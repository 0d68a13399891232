"""The frontend: the OpenAI HTTP service, model discovery and the per-model pipelines."""
