"""Public ops: validation, dispatch through the registry, autograd."""
