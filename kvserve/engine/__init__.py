"""Engines: the synchronous LLMEngine (offline API) and, for the server, the async engine."""
