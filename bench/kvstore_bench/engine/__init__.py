"""`kvstore bench engine`: real vLLM engines serving agent sessions, per KV backing."""
