"""OpenAI-compatible HTTP API: protocol models, request handlers, the FastAPI app and its runner."""
