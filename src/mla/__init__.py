"""mla: Multi-head Latent Attention (DeepSeek-V2/V3/V3.2, Kimi K2) for LLM inference."""
from . import ops
from .batch import Batch
from .cache import CacheFullError, PagedLatentCache
from .config import LongRope, MLAConfig, RopeScaling
from .graph import StepGraph
from .layer import MLA
from .parallel import Parallel

__all__ = ["MLA", "MLAConfig", "RopeScaling", "LongRope", "PagedLatentCache", "CacheFullError", "Batch", "Parallel",
           "StepGraph", "ops", "hf"]


def __getattr__(name):
    # mla.hf (the transformers drop-in) loads on first use, so `import mla` stays light.
    if name == "hf":
        import importlib
        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
__version__ = "0.1.0"
