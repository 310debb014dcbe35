"""Integrations: ``batchinv.enable()`` and Hugging Face transformers.

``enable`` routes stock torch calls to batchinv; ``transformers`` imports transformers lazily;
``attention_masks`` maps their attention masks to batchinv's attention.  (The
``torch.ops.batchinv.*`` custom ops are registered by the op modules, ``batchinv.ops``.)
"""
