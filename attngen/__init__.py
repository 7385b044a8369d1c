"""attngen: attention kernels generated from declarative specs (see README.md)."""
from ._version import __version__
from .causal_linear import (causal_dot_product, causal_linear_attention, linear_attention,
                            instances, selected_instance, causal_dot_product_with)
from .delta_rule import delta_net, gated_delta_rule, kda, rwkv7
from .flash_attention import flash_attention, flash_attention_varlen
from .paged import paged_decode
from .paged_attention import paged_attention
from .rwkv import wkv5, wkv6

__all__ = ["__version__", "causal_dot_product", "causal_linear_attention", "linear_attention", "instances",
           "selected_instance", "causal_dot_product_with", "wkv5", "wkv6", "paged_decode", "paged_attention",
           "flash_attention", "flash_attention_varlen", "rwkv7", "gated_delta_rule", "kda", "delta_net"]
