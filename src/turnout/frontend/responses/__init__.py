"""OpenAI's Responses API over the chat pipelines, and its store of responses and conversations."""
