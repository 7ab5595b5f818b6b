"""Not vLLM: the test double's stand-in, so `python -m vllm.entrypoints.openai.api_server` runs it."""
