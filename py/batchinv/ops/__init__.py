"""Public ops, one module per op: its public function(s), which validate once
(``batchinv.validation``) and dispatch through the registry, the GPU autograd, the registry
registration and the ``torch.library`` custom op (``_custom_op``)."""
