"""An Envoy external-processing router for LLM inference pools."""

__version__ = "0.1.0"
