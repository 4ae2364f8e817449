"""Prefix hashing and the prefix index (Redis and in-process)."""
