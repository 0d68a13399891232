"""Anthropic's Messages API over the chat pipelines."""
