"""Reliability tests: fault injection, hostile input, sustained load (docs/RELIABILITY.md)."""
