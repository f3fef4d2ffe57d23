"""Model implementations loaded from local Hugging Face directories.

The engine needs only: `load_model` (a module with `.info`), `read_model_info`, the
`AttentionContext` protocol it implements, and `ImageProcessor` for pixel tensors.
"""

from worker.models.attention import AttentionContext, ContiguousCacheContext, DenseCausalContext
from worker.models.image_processor import ImageProcessor
from worker.models.llava import merge_embeddings
from worker.models.loader import load_model, read_model_info
from worker.models.registry import ModelInfo

__all__ = [
    "AttentionContext",
    "ContiguousCacheContext",
    "DenseCausalContext",
    "ImageProcessor",
    "ModelInfo",
    "load_model",
    "merge_embeddings",
    "read_model_info",
]
