"""flashkernel inside other libraries' models.

* :mod:`flashkernel.integrations.transformers`: Hugging Face transformers (5.x) runs its decoder
  models on flashkernel, ``attn_implementation="flashkernel"`` (``pip install
  flashkernel[transformers]``).
"""
