"""Integrations: torch.library custom ops, ``batchinv.enable()`` and Hugging Face transformers.

``torch_library`` registers the ``batchinv::*`` custom ops (imported by ``batchinv``);
``enable`` routes stock torch calls to batchinv; ``transformers`` imports transformers lazily.
"""
