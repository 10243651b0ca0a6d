"""Speculative decoding: proposers and their configuration."""
