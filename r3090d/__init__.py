"""r3090d: keeps a vLLM server on a consumer NVIDIA GPU healthy, unattended."""

__version__ = "0.1.0"
