"""The torch code of the patches, one module named after each patch (and ``delta_net_varlen``, ``moe_routing``: kernels
two patches share); none of it knows the registry."""
