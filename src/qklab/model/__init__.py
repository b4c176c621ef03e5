from qklab.model.attention import Attention, KVCache
from qklab.model.gpt import GPT
from qklab.model.mla import LatentCache, MLAttention
from qklab.model.rope import Rope

__all__ = ["GPT", "Attention", "KVCache", "LatentCache", "MLAttention", "Rope"]
