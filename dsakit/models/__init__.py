"""A small DeepSeek-V4 model trained on synthetic long documents, so that index-key formats can be compared on
a model whose lightning indexer was really trained (see models/dsakit-v4-tiny/README.md).

* :mod:`dsakit.models.config`: the architecture (``model_config``) and the training's changes to a built model;
* :mod:`dsakit.models.tokenizer`: the offline tokenizer (vocabulary of the needle generator, characters as
  fallback), saved as ``tokenizer.json``;
* :mod:`dsakit.models.data`: the training documents (haystacks with passkeys and key-value facts);
* :mod:`dsakit.models.losses`: the LM losses and the indexer KL;
* :mod:`dsakit.models.settings`: every setting of a run, checked up front, and recipe files (one per shipped
  checkpoint, e.g. models/dsakit-v4-tiny/recipe.json);
* :mod:`dsakit.models.loop`: the three stages (dense warm-up, indexer KL, sparse training) on transformers'
  ``DeepseekV4ForCausalLM``, saving and the final evaluation;
* :mod:`dsakit.models.train`: the command line (``dsakit train``, ``python -m dsakit.models.train``);
* :mod:`dsakit.models.checkpoint`: strict checkpoint loading.

Needs transformers (with DeepSeek-V4) and tokenizers: ``pip install 'dsakit[serve]'``.
"""
