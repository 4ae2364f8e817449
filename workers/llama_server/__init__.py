"""A llama.cpp llama-server managed by the worker: the binary, the process, and the Backend over its HTTP API."""
