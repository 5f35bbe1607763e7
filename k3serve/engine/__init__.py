"""Engines: LLMEngine (synchronous step loop), AsyncEngine (asyncio streams), LLM (offline API)."""
