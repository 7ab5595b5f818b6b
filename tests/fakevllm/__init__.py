"""A vLLM test double: real HTTP, a real process tree, vLLM's argv. See README.md."""
