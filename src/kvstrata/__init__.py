"""kvstrata: a tiered KV-cache block manager for LLM inference."""

__version__ = "0.1.0"
