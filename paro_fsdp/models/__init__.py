from .llama import FLAVORS, Llama, LlamaArgs, ModelOutput

__all__ = ["FLAVORS", "Llama", "LlamaArgs", "ModelOutput"]
