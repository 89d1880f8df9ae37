"""The torch code of the patches, one module named after each patch (and ``delta_net_varlen``, a kernel module of
its own; routing replay's package holds the MoE routing core the Ascend routing fix shares); none of it knows the
registry."""
