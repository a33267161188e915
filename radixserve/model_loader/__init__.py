"""Weights: safetensors folders, GGUF files, random (dummy) weights, and the embedded SmolLM2."""

from radixserve.model_loader.loader import get_model

__all__ = ["get_model"]
