"""dp_runtime/: one rank — config, DP step sync and plan, the DP buffer service, gather/scatter.

Layers import only downwards (launch > dp_runtime > graph > dispatcher > buffers). Import the
submodules (``dp_runtime.config``, ``dp_runtime.sync.step_sync``, ``dp_runtime.sync.dp_buffer``
...): this package file stays empty of imports so that importing one concept does not import them
all.
"""
