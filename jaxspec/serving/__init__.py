"""Serving: the OpenAI-compatible HTTP server, its metrics and its load benchmark."""
