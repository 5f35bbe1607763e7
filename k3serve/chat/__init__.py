"""Chat rendering: OpenAI-style messages -> prompt token ids (K3 XTML in Python; K2 via Jinja)."""
