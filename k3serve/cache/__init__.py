"""Cache bookkeeping and sizing (pure Python: never imports torch)."""
