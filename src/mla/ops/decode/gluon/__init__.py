"""The Hopper (sm90) decode kernels in Gluon: ``seesaw`` (query rows on the MMAs' M), ``narrow``
(keys on M, few query rows), ``fp8`` (e4m3 MMAs over FP8 rows, few query rows), and ``common``,
the toolkit they share. ``mla.ops.decode.choose_kernel`` chooses among them. ``sparse`` is the
seesaw over gathered rows, for ``mla.ops.sparse_attention`` (sparse MLA).
"""
