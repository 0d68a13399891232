"""The OpenAI-compatible HTTP application, and what every route shares: errors, surfaces, the
OpenAPI document."""
