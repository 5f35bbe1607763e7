"""Request lifecycle and step scheduling (pure Python: never imports torch)."""
