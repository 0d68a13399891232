"""OpenAI's chat completions and completions: running a chat request, its choices, and writing
its responses (the run path the Responses and Anthropic surfaces share)."""
