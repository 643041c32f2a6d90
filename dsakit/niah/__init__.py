"""Needle-in-a-haystack sweeps against OpenAI-compatible servers, and a reference server to test them.

* :func:`dsakit.niah.sweep.run_sweep` (CLI ``dsakit niah``): context length x depth grid, distinct filler,
  exact lengths (local tokenizer or calibration from ``usage.prompt_tokens``), robust async running,
  append-only JSONL with resume, per-cell lines, summary table and heatmap.
* :mod:`dsakit.niah.retrieval`: a transparent retrieval procedure built on dsakit's indexer, not a language
  model, whose answers depend on the index-key format and top-k; ``dsakit serve-reference``
  (:mod:`dsakit.serve.reference`) serves it over an OpenAI-compatible API to test harnesses.

See docs/niah.md.
"""
