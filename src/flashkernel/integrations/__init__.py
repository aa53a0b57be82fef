"""flashkernel inside other libraries' models.

* :mod:`flashkernel.integrations.transformers`: Hugging Face transformers (5.17 or a later 5.x)
  runs its decoder models on flashkernel, ``attn_implementation="fk_attention"`` (``pip install
  flashkernel[transformers]``).
"""
