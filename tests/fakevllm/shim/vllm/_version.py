# Read by r3090d.argv's version probe when no vllm distribution metadata is installed.
__version__ = version = "0.32.0"
