"""OpenAI-compatible HTTP server: FastAPI app, request/response shapes, output parsers, metrics."""
