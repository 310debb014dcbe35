"""Other projects' op APIs, mapped onto batchinv's ops.

``batchinv.compat.rl_kernel``: RL-Kernel's ``Native*Op`` modules, ``OpBackend`` and
``kernel_registry.get_op`` (docs/migrating-from-rl-kernel.md).
"""
