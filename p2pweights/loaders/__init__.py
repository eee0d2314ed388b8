"""Engines that load weights straight from a download: transformers (``hf``) and vLLM (``vllm``)."""
