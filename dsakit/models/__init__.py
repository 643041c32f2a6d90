"""A small DeepSeek-V4 model trained on synthetic long documents, so that index-key formats can be compared on
a model whose lightning indexer was really trained (see models/dsakit-v4-tiny/README.md).

* :mod:`dsakit.models.tokenizer`: the offline tokenizer (vocabulary of the needle generator, characters as
  fallback), saved as ``tokenizer.json``;
* :mod:`dsakit.models.data`: the training documents (haystacks with passkeys and key-value facts);
* :mod:`dsakit.models.train`: the DSA recipe (dense warm-up, indexer KL, sparse training) on transformers'
  ``DeepseekV4ForCausalLM`` (``python -m dsakit.models.train``).

Needs transformers (with DeepSeek-V4) and tokenizers: ``pip install 'dsakit[serve]'``.
"""
