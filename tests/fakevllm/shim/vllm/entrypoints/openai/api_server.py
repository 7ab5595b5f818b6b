"""Runs the vLLM test double (tests/fakevllm/server.py) under vLLM's module name."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parents[4] / "server.py"), run_name="__main__")
